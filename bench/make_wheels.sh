#!/usr/bin/env bash
# Fills .wheels/ (ignored by git) with wheels of what the GPU image lacks, for its Python 3.12:
# the server (fastapi, uvicorn, httpx2 and their needs), the openai client, torchao, xgrammar,
# gemlite (an sdist: built here, pure Python), and in .wheels/lm_eval/ lm-eval[api] 0.4.13 less the
# image's packages. Run from the repository root on a machine with PyPI; a device call carries
# .wheels and installs with `python3 -m pip install -q --no-index --no-deps --no-compile .wheels/*.whl`
# (and `.wheels/lm_eval/*.whl` for bench/serve_lm_eval.py). ~27 MB.
set -euo pipefail
PLAT="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp"
for n in 17 24 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
PLAT="$PLAT --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
mkdir -p .wheels/lm_eval
# The image has anyio, h11, click and typing-extensions, older than these need: newer ones travel too.
for req in fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions anyio \
           idna uvicorn httpx2 httpcore2 truststore openai jiter distro sniffio opentelemetry-api \
           'torchao>=0.18,<0.19' 'xgrammar>=0.2.8,<0.3' apache-tvm-ffi; do
  python3 -m pip download -q $PLAT -d .wheels "$req"
done
python3 -m pip wheel -q --no-deps -w .wheels 'gemlite>=0.6,<0.7'
# Pinned as pip resolved lm-eval[api] 0.4.13 on 2026-12-07 (mbstrdecoder wants chardet<7, dataproperty typepy<2).
for req in lm-eval==0.4.13 chardet==6.0.0.post1 dataproperty==1.1.1 datasets==5.2.0 defusedxml==0.7.1 dill==0.4.1 \
           evaluate==0.4.6 mbstrdecoder==1.1.5 more-itertools==11.2.1 multiprocess==0.70.19 nltk==3.10.4 \
           pathvalidate==3.3.1 pytablewriter==1.2.1 pytz==2026.6 tabledata==1.3.5 tcolorpy==0.1.7 tenacity==9.2.1 \
           typepy==1.3.5; do
  python3 -m pip download -q $PLAT -d .wheels/lm_eval "$req"
done
python3 -m pip wheel -q --no-deps -w .wheels/lm_eval rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1  # sdists
du -sh .wheels
