from duoka.models.qwen2.args import FLAVORS, ModelArgs, from_hf_config, get_flavor, to_hf_config
from duoka.models.qwen2.hf_adapter import load_hf_model, load_hf_weights, save_hf_checkpoint
from duoka.models.qwen2.model import Qwen2, build_model, materialize

__all__ = [
    "FLAVORS", "ModelArgs", "Qwen2", "build_model", "from_hf_config", "get_flavor",
    "load_hf_model", "load_hf_weights", "materialize", "save_hf_checkpoint", "to_hf_config",
]
