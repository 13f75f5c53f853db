"""duoka's tokenizer against transformers' AutoTokenizer on the same folder."""

import json
import shutil

import pytest

from duoka.data.tokenizer import Tokenizer
from duoka.errors import DuokaError

TEXTS = [
    "Hello world",
    "The quick brown fox — it's 12,345 foxes!",
    "中文分词测试：你好，世界。",
    "emoji 🙂🚀 and unseen glyphs ☃ ∮ 𝔘",
    "  leading spaces\n\n\ttabs and trailing   ",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "中文呢？"}],
]

# A tool-calling template in the style of Qwen2.5's: exercises tojson, whitespace
# control, loop variables and raise_exception.
TOOLS_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}{{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' }}
    {%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}
    {%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}
    {{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <b>& \"Temperatur\"</b>",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def hf_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_encode_decode_match_transformers(tokenizer_dir):
    ours, theirs = Tokenizer(tokenizer_dir), hf_tokenizer(tokenizer_dir)
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ours.encode(TEXTS[2])) == TEXTS[2]
    assert ours.eos_id == theirs.eos_token_id and ours.pad_id == theirs.pad_token_id


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_chat_template_matches_transformers(tokenizer_dir, generation_prompt):
    ours, theirs = Tokenizer(tokenizer_dir), hf_tokenizer(tokenizer_dir)
    for conv in CONVERSATIONS:
        text = ours.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=False)
        assert text == theirs.apply_chat_template(conv, add_generation_prompt=generation_prompt, tokenize=False)
        ids = ours.apply_chat_template(conv, add_generation_prompt=generation_prompt)
        assert ids == theirs.apply_chat_template(conv, add_generation_prompt=generation_prompt, return_dict=False)


def _with_template_file(tokenizer_dir, tmp_path, template):
    """The layout newer transformers write: the template in chat_template.jinja."""
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def test_tools_template_from_jinja_file_matches_transformers(tokenizer_dir, tmp_path):
    folder = _with_template_file(tokenizer_dir, tmp_path, TOOLS_TEMPLATE)
    ours, theirs = Tokenizer(folder), hf_tokenizer(folder)
    for conv in CONVERSATIONS:
        for tools in (None, TOOLS):
            kw = dict(tools=tools, add_generation_prompt=True, tokenize=False)
            assert ours.apply_chat_template(conv, **kw) == theirs.apply_chat_template(conv, **kw)
    text = ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, tokenize=False)
    assert '"description": "Wetter <b>& \\"Temperatur\\"</b>"' in text  # tojson without HTML escaping


def test_generation_spans_cover_the_assistant_turns(tokenizer_dir, tmp_path):
    folder = _with_template_file(tokenizer_dir, tmp_path, TOOLS_TEMPLATE)
    conv = CONVERSATIONS[1] + [{"role": "assistant", "content": "很好"}]
    text, spans = Tokenizer(folder).render_chat(conv)
    assert [text[a:b] for a, b in spans] == ["4<|im_end|>", "很好<|im_end|>"]


def test_named_template_list_in_config(tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": TOOLS_TEMPLATE},
                            {"name": "default", "template": cfg["chat_template"]}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, theirs = Tokenizer(folder), hf_tokenizer(folder)
    kw = dict(add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(CONVERSATIONS[1], **kw) == theirs.apply_chat_template(CONVERSATIONS[1], **kw)


def test_template_errors_are_user_errors(tokenizer_dir, tmp_path):
    folder = _with_template_file(tokenizer_dir, tmp_path, TOOLS_TEMPLATE)
    with pytest.raises(DuokaError, match="unknown role robot"):
        Tokenizer(folder).apply_chat_template([{"role": "robot", "content": "beep"}])


def test_no_chat_template(tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(DuokaError, match="no chat template") as e:
        Tokenizer(folder).apply_chat_template(CONVERSATIONS[0])
    assert "--chat" in e.value.fix


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DuokaError, match="has no tokenizer.json") as e:
        Tokenizer(tmp_path)
    assert "config.json" in e.value.cause


def test_stop_ids_include_generation_config(tokenizer_dir, tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    tok = Tokenizer(folder)
    endoftext = tok.token_to_id("<|endoftext|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [endoftext, tok.eos_id]}))
    assert Tokenizer(folder).stop_ids() == {endoftext, tok.eos_id}
