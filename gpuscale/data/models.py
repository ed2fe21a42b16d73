"""The models gpuscale knows by name, and loading any model by name, hub id or local path.

Random models are built from a config with no download: they exercise the machinery (memory, speed)
at a real model's shape. Import of torch/transformers happens inside the functions so that listing
models stays cheap.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path
from typing import Any

from gpuscale.data.paths import absolute_path
from gpuscale.data.precision import PRECISIONS, TORCH_NAMES, device_precision, torch_dtype

# Shapes copied from the public configs, so speed and memory match the real models.
RANDOM_CONFIGS: dict[str, dict[str, Any]] = {
    "random-tiny": dict(
        model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=True,
    ),
    "random-qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
    "random-qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}


def random_model_config(name: str):
    from transformers import AutoConfig

    spec = dict(RANDOM_CONFIGS[name])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def build_random_model(name: str, seed: int = 0, device=None, dtype=None):
    """A model of a known shape with random weights: fp32 on the CPU, or made where `device` and
    `dtype` say (its random draws then come from that device's generator: other weights than the
    CPU's for the same seed). Made on a GPU, a 0.5B model's initialisation takes a fraction of a
    second instead of seconds of one CPU thread."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        return AutoModelForCausalLM.from_config(random_model_config(name), dtype=dtype or torch.float32)


# ---------------------------------------------------------------------------------------------------
# Every model by name, hub id or local path

TINY_MATH = "tiny-math"
KNOWN_MODELS: tuple[str, ...] = (TINY_MATH, *RANDOM_CONFIGS)
MODEL_DESCRIPTIONS = {
    TINY_MATH: "embedded Llama trained on the tiny-math tasks (tools/train_tiny.py)",
    "random-tiny": "random weights, tiny Llama shape, no tokenizer",
    "random-qwen2.5-0.5b": "random weights at Qwen2.5-0.5B's shape, no tokenizer",
    "random-qwen2.5-1.5b": "random weights at Qwen2.5-1.5B's shape, no tokenizer",
}
# "org/name" as the hub spells repository ids; anything else that is not a directory is a typo.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
# The dtype names the loader takes besides the precision setting's own: torch's (bfloat16 for bf16...).
_LONG_DTYPE_NAMES = {long: short for short, long in TORCH_NAMES.items()}


class ModelError(ValueError):
    """A model that cannot be loaded; the message is one line that says why and what to do."""


def model_path(name: str = TINY_MATH) -> Path:
    """The directory of an embedded model (only tiny-math has files)."""
    if name != TINY_MATH:
        raise ModelError(f"{name!r} is not an embedded model; the embedded one is {TINY_MATH!r}")
    return Path(__file__).resolve().parent / "models" / TINY_MATH


def looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name))


def resolve_dtype(dtype, device="cpu"):
    """A torch dtype from None (keep the checkpoint's), a torch.dtype, or a name.

    Names: fp32/float32, bf16/bfloat16, fp16/float16, and "auto", which means on `device` what it
    means for a run's `precision` (data/precision.py's rule: bf16 on GPUs of compute capability 8.0
    and up, fp16 on older GPUs, fp32 on the CPU).
    """
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    name = _LONG_DTYPE_NAMES.get(name, name)
    if name not in PRECISIONS:
        known = ", ".join(PRECISIONS + tuple(_LONG_DTYPE_NAMES))
        raise ModelError(f"unknown dtype {dtype!r}; known: {known}")
    return torch_dtype(device_precision(name, device))


def load_model(name_or_path, dtype=None, device="cpu"):
    """(model, tokenizer or None) for a known name, a local directory or a hub id.

    Random models come without a tokenizer. The model is in eval mode on `device`.
    """
    name = str(name_or_path)
    torch_dtype = resolve_dtype(dtype, device)
    if name in RANDOM_CONFIGS:
        if _is_gpu(device):  # made where it runs: every rank's GPU draws the same weights from the same seed
            return build_random_model(name, device=device, dtype=torch_dtype).eval(), None
        model = build_random_model(name)
        model = model.to(torch_dtype) if torch_dtype is not None else model
        return model.to(device).eval(), None
    if name == TINY_MATH:
        return _load_pretrained(str(model_path()), torch_dtype, device, local=True)
    if Path(name).expanduser().is_dir():
        return _load_pretrained(str(Path(name).expanduser()), torch_dtype, device, local=True)
    if looks_like_hub_id(name):
        return _load_pretrained(name, torch_dtype, device, local=False)
    raise ModelError(
        f"unknown model {name!r}: not a known name ({', '.join(KNOWN_MODELS)}), "
        f"not a local directory, not a hub id like org/name"
    )


def _is_gpu(device) -> bool:
    import torch

    return torch.device(device).type == "cuda"


def _load_pretrained(source: str, torch_dtype, device, local: bool):
    from transformers import AutoModelForCausalLM

    options = {"local_files_only": True} if local else {}
    if torch_dtype is not None:
        options["dtype"] = torch_dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **options)
    except OSError as error:  # transformers' way of saying: files missing, or the hub unreachable
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        where = "the local directory" if local else "the Hugging Face hub"
        hint = "" if local else "; download it first or pass a local directory with the model"
        raise ModelError(f"could not load model {source!r} from {where}: {reason}{hint}") from None
    return model.to(device).eval(), _load_tokenizer(source, local)


def _load_tokenizer(source: str, local: bool):
    """The model's tokenizer, or None where the checkpoint has none (a bare weights directory)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError):
        return None


def load_tokenizer(name: str):
    """The tokenizer of a model as `load_model` would give it (None for a random model, or a
    checkpoint without one), without loading any weights."""
    if name in RANDOM_CONFIGS:
        return None
    if name == TINY_MATH:
        return _load_tokenizer(str(model_path()), local=True)
    path = Path(name).expanduser()
    return _load_tokenizer(str(path), local=True) if path.is_dir() else _load_tokenizer(name, local=False)


# Where configs put the longest sequence the model takes (Llama and Qwen: the first; GPT-2: n_positions).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_context(name: str) -> int | None:
    """The most tokens the model takes in one sequence, from its config as plain JSON (no torch, no
    weights): a known model's, a local directory's config.json, a hub model's cached (or fetched)
    config.json; None where no config or no such key is found."""
    config = _config_of(name) if name in KNOWN_MODELS else _config_file_of(name)
    if not config:
        return None
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(section.get(key), int) and section[key] > 0:
                return section[key]
    return None


def _config_file_of(name: str) -> dict | None:
    path = Path(name).expanduser()
    if path.is_dir():
        found = path / "config.json"
    elif looks_like_hub_id(name):
        found = _hub_config(name)
    else:
        return None
    try:
        config = json.loads(Path(found).read_text()) if found else None
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _hub_config(repo_id: str) -> str | None:
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        return cached
    try:
        return hf_hub_download(repo_id, "config.json")
    except Exception:  # offline, gated, unreachable: the model's own check says which
        return None


def describe_models() -> list[dict[str, Any]]:
    """One row per known model: name, path, parameters, architecture (for `gpuscale models --json`).
    Read from the configs as plain JSON, with the parameters counted from the shape: importing
    transformers and building the models on the meta device took seconds for a listing."""
    rows = []
    for name in KNOWN_MODELS:
        path = model_path() if name == TINY_MATH else None
        config = _config_of(name)
        rows.append({
            "name": name,
            "path": str(path) if path else None,
            "architecture": (config.get("architectures") or [None])[0] if config else None,
            "model_type": config.get("model_type") if config else None,
            "parameters": decoder_parameters(config) if config else None,
            "description": MODEL_DESCRIPTIONS[name],
        })
    return rows


# The causal-LM classes of the model types whose parameters decoder_parameters counts by arithmetic.
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _config_of(name: str) -> dict | None:
    """A known model's config as a dict (the embedded model's config.json, or a random model's spec)."""
    if name in RANDOM_CONFIGS:
        spec = dict(RANDOM_CONFIGS[name])
        return {**spec, "architectures": [CAUSAL_LM_CLASSES[spec["model_type"]]]}
    if not (model_path() / "config.json").is_file():
        return None  # not trained yet in this checkout
    return json.loads((model_path() / "config.json").read_text())


def decoder_parameters(config: dict) -> int:
    """Parameters of a Llama- or Qwen2-shaped decoder, from its config: embeddings, per layer the
    attention projections (and their biases) and the gated MLP and two norms, the final norm,
    and the output head unless tied to the embeddings. Other model types are built on the meta device."""
    if config.get("model_type") not in CAUSAL_LM_CLASSES:
        return _count_parameters(config)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv_width = config.get("num_key_value_heads", heads) * head_dim
    attention = hidden * heads * head_dim * 2 + hidden * kv_width * 2
    if config["model_type"] == "qwen2":  # Qwen2: biases on q, k and v
        attention += heads * head_dim + 2 * kv_width
    elif config.get("attention_bias", False):  # Llama's option: on q, k, v and o
        attention += heads * head_dim + 2 * kv_width + hidden
    mlp = 3 * hidden * config["intermediate_size"]
    if config.get("mlp_bias", False):
        mlp += 2 * config["intermediate_size"] + hidden
    layer = attention + mlp + 2 * hidden
    head = 0 if config.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + config["num_hidden_layers"] * layer + hidden + head


def _count_parameters(config: dict) -> int:
    """Parameters of the model a config describes, counted on the meta device (no memory, no init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **spec))
    return sum(p.numel() for p in model.parameters())


# A hub that does not answer within this is taken as unreachable (the libraries' own waits add up to
# about 30 s before a rank gives up).
HUB_CHECK_TIMEOUT_S = 5.0
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def check_model(name: str) -> None:
    """Refuse, in the front end before anything starts, a model a rank could not load, as far as can
    be known cheaply (no weights are read): a local directory (or the embedded model) must have a
    config.json that parses and names its model_type, weights, and safetensors files whose headers
    read; a hub id must be in the local cache, or the hub must answer for it within
    HUB_CHECK_TIMEOUT_S (none is asked with HF_HUB_OFFLINE). Raises ModelError with one line."""
    if name in RANDOM_CONFIGS:
        return
    path = model_path() if name == TINY_MATH else Path(name).expanduser()
    if path.is_dir():
        check_model_directory(path)
    elif looks_like_hub_id(name) and not is_symlink_loop(path):
        check_hub_model(name)
    else:
        try:
            check_model_name(name)
        except ModelError as error:
            raise ModelError(f"model: {name!r}: {error}") from None


def check_model_directory(path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ModelError(f"model: {path}: no config.json, so not a Hugging Face model directory")
    _check_config(config)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / shard for shard in _read_json(index).get("weight_map", {}).values()})
        missing = [shard.name for shard in files if not shard.is_file()]
        if missing:
            raise ModelError(f"model: {index}: names {missing[0]}, which is not in the directory")
    else:
        files = sorted(file for pattern in WEIGHT_PATTERNS for file in path.glob(pattern))
    if not files:
        raise ModelError(f"model: {path}: no weights (model.safetensors or pytorch_model.bin)")
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors(file)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise ModelError(f"model: {path}: cannot be read ({error})") from None
    except json.JSONDecodeError as error:
        raise ModelError(f"model: {path}: not valid JSON (line {error.lineno}: {error.msg})") from None


def _check_config(path: Path) -> None:
    config = _read_json(path)
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ModelError(f"model: {path}: no model_type, so transformers cannot tell which model it is")
    _refuse_custom_code(config, path)


def _refuse_custom_code(config: dict, path: Path) -> None:
    """A model whose classes are its own folder's code (config.json's `auto_map`, for a model_type
    transformers has no class of its own for) loads only with transformers' `trust_remote_code`, which
    gpuscale never passes: it runs no code that came with a model. Refused here, before launch, rather
    than in every rank with transformers' prompt cut to one line. A model of a type transformers knows
    loads with transformers' own class, whatever its auto_map says, and passes."""
    auto_map = config.get("auto_map")
    model_type = str(config["model_type"])
    if not auto_map or transformers_knows(model_type):
        return
    classes = ", ".join(f"{name} -> {target}" for name, target in auto_map.items()) if isinstance(auto_map, dict) \
        else str(auto_map)
    raise ModelError(f"model: {path}: model_type {model_type!r} is not one transformers knows, and its auto_map "
                     f"({classes}) names code of the model's own, which transformers runs only with "
                     "trust_remote_code; gpuscale runs no code that comes with a model: use a model of a type "
                     "transformers supports (gpuscale models lists the built-in ones)")


def transformers_knows(model_type: str) -> bool:
    """Whether transformers has a configuration class of its own for `model_type`. Its models' folders
    are looked for first (no import: transformers takes seconds to import, and its table pulls in torch);
    only a type with no folder of its name is looked up in the table itself."""
    from importlib.util import find_spec

    spec = find_spec("transformers")
    folders = spec.submodule_search_locations if spec else None
    if folders and any((Path(folder) / "models" / model_type.replace("-", "_")).is_dir() for folder in folders):
        return True
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


def _check_safetensors(path: Path) -> None:
    """The header only (safetensors checks that it parses and that its tensors cover the file
    exactly, so a truncated download is caught too); no tensor is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as handle:
            handle.metadata()
    except (SafetensorError, OSError) as error:
        raise ModelError(f"model: {path}: not a readable safetensors file ({error}); download it again") from None


def check_hub_model(repo_id: str) -> None:
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        _check_config(Path(cached))
        return
    get_it = f"download it first (`hf download {repo_id}`) or pass a local model directory"
    if constants.is_offline_mode():
        raise ModelError(f"model: {repo_id!r}: not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         f"and HF_HUB_OFFLINE is set; {get_it}")
    try:
        HfApi().model_info(repo_id, timeout=HUB_CHECK_TIMEOUT_S)
    except GatedRepoError:
        raise ModelError(f"model: {repo_id!r}: gated on the Hugging Face hub; accept its terms there and log in "
                         "(`hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ModelError(f"model: {repo_id!r}: no such model on the Hugging Face hub (if it is private, log in "
                         "with `hf auth login`)") from None
    except Exception as error:  # httpx's connection errors and timeouts, the hub's HTTP errors
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise ModelError(f"model: {repo_id!r}: the Hugging Face hub cannot be reached ({reason}) and the model "
                         f"is not in the local cache; {get_it}") from None


def check_model_name(name: str) -> str:
    """Refuse, before anything starts, a model that is neither known, nor a local directory, nor
    shaped like a hub id (whether the hub has it is only known when a rank loads it). A local
    directory comes back as an absolute path: the ranks start in the run folder, not in the user's."""
    if name in KNOWN_MODELS:
        return name
    path = Path(name).expanduser()
    if path.is_dir():
        return str(absolute_path(path))
    if is_symlink_loop(path):  # before the hub id: `models/loop` is shaped like one
        raise ModelError(f"{path} is a symbolic link loop (it leads back to itself), not a model directory")
    if looks_like_hub_id(name):
        return name
    raise ModelError(f"unknown model; known models: {', '.join(KNOWN_MODELS)} "
                     "(or a local model directory, or a hub id like org/name)")


def is_symlink_loop(path: Path) -> bool:
    """Whether following `path` goes round in symbolic links (ELOOP), which `is_dir` and `exists`
    only report as False."""
    try:
        path.stat()
    except OSError as error:
        return error.errno == errno.ELOOP
    return False
