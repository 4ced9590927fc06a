"""Load a causal or masked language model: a Hub id, a local folder, a GGUF file, or a tiny random config.

Over 400 lines: every model source (Hub, folder, GGUF, random config) is resolved, checked and loaded here.

Where the weights come from is decided by :func:`resolve_source` before anything heavy happens, so that a
missing local file is reported in one line before a model loads. Offline runs never contact the Hub: when a
local model directory is set, ``HF_HUB_OFFLINE`` is switched on for the process.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from adazeta.adapters.sites import check_placements
from adazeta.errors import ConfigError
from adazeta.tasks.family import CAUSAL, FAMILIES, MASKED
from adazeta.tasks.family import family as as_family
from adazeta.precision import ADAPTER_DTYPES, COMPILE_BACKENDS, QUANTIZATIONS

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODEL_DIR_ENV = "ADAZETA_MODEL_DIR"


@dataclass
class ModelConfig:
    """Which model to load and how. See ``conf/model_defaults.yaml`` and ``conf/model/*.yaml``."""

    name: str
    # causal (decoder, MeZO protocol) or masked (RoBERTa-style, LM-BFF protocol); None: read from the model's config
    family: str | None = "causal"
    hub_id: str | None = None  # Hugging Face Hub id, used when no local copy is configured
    path: str | None = None  # a save_pretrained folder or a .gguf file, used instead of hub_id / local_name
    local_name: str | None = None  # folder under the model directory holding the local copy
    gguf_file: str | None = None  # a GGUF file inside that folder (transformers dequantizes it)
    random_init: bool = False  # build from `architecture` with random weights (tests, dry runs)
    # model_type + config fields; dry runs build it on `meta`. None: read from the model's own config.
    architecture: dict[str, Any] | None = None
    dtype: str = "fp32"  # fp32, bf16 or fp16 for the backbone; adapters' weights always stay fp32
    # The adapters' products: fp32 (inputs cast up, outputs cast back) or backbone (autocast to model.dtype; their
    # weights and ZO perturbations stay fp32). Same as fp32 on an fp32 backbone.
    adapter_dtype: str = "fp32"
    # torch.compile backend for the backbone (with its adapters): inductor, aot_eager or eager; None: not compiled
    compile: str | None = None
    # The frozen backbone's linear layers (adapter methods only): int8, int8 weights with a scale per row;
    # bf16, bf16 weights multiplied in bf16 on activations that stay in model.dtype between them
    quantize: str | None = None
    device: str = "auto"  # auto picks CUDA when present, else CPU
    # Spread the model over the visible GPUs (accelerate's dispatch: auto, balanced, balanced_low_0, sequential;
    # CPU offload as a last resort) instead of loading it on `device`: for models larger than one GPU.
    device_map: str | None = None
    max_length: int = 512  # prompt + candidate tokens; longer prompts are truncated (scoring.encode)
    model_dir: str | None = None  # local model directory; defaults to $ADAZETA_MODEL_DIR
    revision: str | None = None  # Hub revision, for reproducible downloads
    tt_shapes: dict[str, list[int]] | None = None  # the reference code's TT modes {down, up} for this hidden size
    # Adapter sites by model_type and placement: {model_type: {official: [{pattern, position}], paper: [...]}}.
    # A model_type not listed gets the MLP projections found from its module structure (adapters/sites.py).
    placements: dict[str, dict[str, list[dict[str, str]]]] | None = None

    def __post_init__(self) -> None:
        if self.family is not None and self.family not in FAMILIES:
            raise ConfigError(f"model.family={self.family!r} is not one of {', '.join(FAMILIES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.adapter_dtype not in ADAPTER_DTYPES:
            raise ConfigError(f"model.adapter_dtype={self.adapter_dtype!r} is not one of {', '.join(ADAPTER_DTYPES)}")
        if self.compile is not None and self.compile not in COMPILE_BACKENDS:
            raise ConfigError(f"model.compile={self.compile!r} is not null or one of {', '.join(COMPILE_BACKENDS)}")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise ConfigError(f"model.quantize={self.quantize!r} is not null or one of {', '.join(QUANTIZATIONS)}")
        if self.max_length < 8:
            raise ConfigError(f"model.max_length={self.max_length} must be >= 8")
        if self.random_init and not self.architecture:
            raise ConfigError(f"model {self.name!r} has random_init=true but no `architecture` to build from")
        if not self.random_init and not (self.hub_id or self.local_name or self.path):
            raise ConfigError(f"model {self.name!r} needs model.hub_id=<org/name> or model.path=<folder or .gguf file>")
        if self.placements is not None:
            check_placements(self.placements, "model.placements")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"model.device={self.device!r} must be auto, cpu, cuda or cuda:N")
        if self.device_map is not None and self.device_map not in DEVICE_MAPS:
            raise ConfigError(f"model.device_map={self.device_map!r} must be null or one of {', '.join(DEVICE_MAPS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def hidden_size(self) -> int | None:
        return architecture_config(self).hidden_size if self.architecture else None


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


@dataclass
class ModelSource:
    kind: str  # random, local, hub
    path: str | None = None  # folder (local) or hub id (hub)
    gguf_file: str | None = None


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    family: str
    source: ModelSource
    device: torch.device


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r} but no CUDA device is visible; use model.device=auto or cpu")
    return torch.device(name)


def resolve_source(cfg: ModelConfig) -> ModelSource:
    """Decide where the weights come from, checking local files exist. Cheap: loads nothing."""
    if cfg.random_init:
        return ModelSource("random")
    if cfg.path:
        source = path_source(cfg.path, cfg.gguf_file)
        if source.gguf_file:
            check_gguf(Path(source.path) / source.gguf_file)
        else:
            check_pretrained_folder(Path(source.path))
        return source
    model_dir = cfg.model_dir or os.environ.get(MODEL_DIR_ENV)
    if model_dir:
        source = model_dir_source(cfg, model_dir)
        if source.gguf_file:
            check_gguf(Path(source.path) / source.gguf_file)
        else:
            check_pretrained_folder(Path(source.path))
        return source
    if not cfg.hub_id:
        raise ConfigError(f"model {cfg.name!r} has no hub_id; set {MODEL_DIR_ENV} to a folder holding {cfg.local_name}/")
    return ModelSource("hub", cfg.hub_id)


def model_dir_source(cfg: ModelConfig, model_dir: str) -> ModelSource:
    """The model's copy in the local model directory (``model.model_dir`` or $ADAZETA_MODEL_DIR): the GGUF file the
    model config names, or a save_pretrained folder, under ``local_name``. A set directory means offline: a model it
    lacks fails here, in one line, and is never looked for on the Hub. Checks only that the files exist."""
    if not cfg.local_name:
        name = (cfg.hub_id or cfg.name).rstrip("/").split("/")[-1]
        raise ConfigError(
            f"model {cfg.hub_id or cfg.name} is not in the local model directory {model_dir} ({MODEL_DIR_ENV} or "
            f"model.model_dir; the Hub is not used while it is set) and model.local_name is unset; save the model to "
            f"{Path(model_dir).expanduser() / name} and set model.local_name={name} (or model.path=<its folder>), or "
            f"unset {MODEL_DIR_ENV} to download it"
        )
    folder = Path(model_dir).expanduser() / cfg.local_name
    # A local copy is either the GGUF file named in the model config or a save_pretrained folder.
    if cfg.gguf_file and (folder / cfg.gguf_file).is_file():
        return ModelSource("local", str(folder), cfg.gguf_file)
    if (folder / "config.json").is_file():
        return ModelSource("local", str(folder))
    wanted = folder / cfg.gguf_file if cfg.gguf_file else folder / "config.json"
    hub = f", or unset it to download {cfg.hub_id} from the Hub" if cfg.hub_id else ""
    raise ConfigError(
        f"model file not found: {wanted}; put the model there (a save_pretrained folder also works) or point "
        f"{MODEL_DIR_ENV} (or model.model_dir) at the folder that holds {cfg.local_name}/{hub}"
    )


def path_source(path: str, gguf_file: str | None = None) -> ModelSource:
    """``model.path``: a .gguf file, or a folder holding config.json or ``gguf_file``. Checks only that it exists."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource("local", str(p.parent), p.name)
    if p.is_dir() and gguf_file and (p / gguf_file).is_file():
        return ModelSource("local", str(p), gguf_file)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource("local", str(p))
    raise ConfigError(f"model.path={path} is neither a .gguf file nor a folder holding config.json; point it at a "
                      "save_pretrained folder or a .gguf file")


GGUF_MAGIC = b"GGUF"
GGUF_HEADER = 24  # magic, version (uint32), tensor count (uint64), metadata count (uint64)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Files that carry a tokenizer's vocabulary: fast (tokenizer.json), sentencepiece (*.model), BPE / WordPiece vocab
# files, tiktoken ranks. A folder with none of them cannot be tokenized, whatever its tokenizer_config.json says.
TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def check_gguf(path: Path) -> None:
    """A GGUF file's header, read without loading anything: a truncated or foreign file fails in one line."""
    try:
        with open(path, "rb") as f:
            head = f.read(GGUF_HEADER)
    except OSError as err:
        raise ConfigError(f"cannot read the model file {path}: {err.strerror}") from None
    fix = "download it again, or point model.gguf_file at a complete .gguf file"
    if len(head) < GGUF_HEADER:
        raise ConfigError(f"model file {path} holds {len(head)} bytes, too few for a GGUF header; {fix}")
    if head[:4] != GGUF_MAGIC:
        raise ConfigError(f"model file {path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF'); {fix}")
    version = int.from_bytes(head[4:8], "little")
    tensors = int.from_bytes(head[8:16], "little")
    if version not in (1, 2, 3) or tensors == 0:
        raise ConfigError(f"model file {path} has a GGUF header with version {version} and {tensors} tensors; {fix}")


def check_pretrained_folder(folder: Path) -> None:
    """A save_pretrained folder: a config.json that parses, and weights and a tokenizer beside it."""
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{folder / 'config.json'} is not valid JSON ({err}); save the model again") from None
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ConfigError(
            f"model folder {folder} has a config.json but no weights ({', '.join(WEIGHT_FILES[::2])}); "
            "save the model with save_pretrained, or copy its weight files there"
        )
    if not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
        raise ConfigError(
            f"model folder {folder} has weights but no tokenizer ({', '.join(TOKENIZER_FILES[:4])}); save the "
            "model's tokenizer beside them (tokenizer.save_pretrained(folder)) or copy its tokenizer files there"
        )


# Whole-word tokens of the tiny tokenizer: the label words and candidates of the task specs, so that tiny test
# models exercise the same single-token paths (shared prompt, mask scoring) as real tokenizers do.
TINY_WORDS = (
    "terrible bad okay good great Yes No Maybe Description Entity Expression Human Location Number "
    "positive negative true false"
).split()


def byte_tokenizer(words: tuple[str, ...] | list[str] = TINY_WORDS) -> Any:
    """A byte-level BPE tokenizer built in memory, for tiny random test models.

    Its vocabulary is the 256 bytes, five special tokens, and merges that make each of ``words`` (with and
    without a leading space) a single token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    vocab = {tok: i for i, tok in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges: list[tuple[str, str]] = []
    # Space-prefixed forms first: their merges then outrank the bare forms' inside " word".
    for form in [" " + w for w in words] + list(words):
        ((piece, _),) = byte_level.pre_tokenize_str(form)  # bytes -> the byte-level alphabet
        for i in range(2, len(piece) + 1):
            if piece[:i] not in vocab:
                vocab[piece[:i]] = len(vocab)
                merges.append((piece[: i - 1], piece[i - 1]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        mask_token="<mask>",
    )


def architecture_config(cfg: ModelConfig, vocab_size: int | None = None) -> Any:
    """A transformers config from the model YAML's ``architecture`` block."""
    from transformers import AutoConfig

    arch = dict(cfg.architecture or {})
    model_type = arch.pop("model_type", None)
    if not model_type:
        raise ConfigError(f"model {cfg.name!r}: `architecture` needs a model_type (e.g. llama, roberta)")
    if vocab_size is not None:
        arch["vocab_size"] = vocab_size
    try:
        return AutoConfig.for_model(model_type, **arch)
    except Exception as err:  # an unknown model_type, or sizes transformers' validators reject
        raise ConfigError(f"model {cfg.name!r}: transformers rejects its `architecture` ({first_line(root_cause(err))}); "
                          "fix model.architecture") from None


def pretrained_kwargs(cfg: ModelConfig, source: ModelSource) -> dict[str, Any]:
    """The ``from_pretrained`` arguments of a source: its GGUF file, and the pinned revision of a Hub model."""
    kwargs: dict[str, Any] = {}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if cfg.revision and source.kind == "hub":
        kwargs["revision"] = cfg.revision
    return kwargs


def root_cause(err: BaseException) -> BaseException:
    """The innermost exception of a chain: the one that says what was wrong (a validator's ValueError)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def first_line(err: BaseException) -> str:
    """An exception as one short line for a user-facing message: its type and the first line of its text; a first
    line that only introduces a list (torch's "Error(s) in loading state_dict for X:") gives way to the list's
    first entry, which holds the detail (the sizes that differ), and a count of the others."""
    text = str(err).strip()
    if not text:
        return type(err).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line, limit = lines[0], 200
    if line.endswith(":") and len(lines) > 1:
        line, limit = lines[1] + (f" (and {len(lines) - 2} more like it)" if len(lines) > 2 else ""), 320
    if len(line) > limit:  # cut at a sentence's or a word's end, never inside a word
        cut = line[:limit]
        end = cut.rfind(". ")
        line = cut[:end + 1] if end >= 80 else cut.rsplit(" ", 1)[0] + " ..."
    return f"{type(err).__name__}: {line}"


def source_config(cfg: ModelConfig) -> Any:
    """The transformers config of the model ``cfg`` names, read from its config.json or GGUF header (no weights)."""
    from transformers import AutoConfig

    model_dir = cfg.model_dir or os.environ.get(MODEL_DIR_ENV)
    if cfg.path:
        source = path_source(cfg.path, cfg.gguf_file)
    elif model_dir:  # offline: the model's local copy, or one line; never the Hub
        source = model_dir_source(cfg, model_dir)
    else:
        source = ModelSource("hub", cfg.hub_id)
    try:
        return AutoConfig.from_pretrained(source.path, **pretrained_kwargs(cfg, source))
    except Exception as err:  # missing, unreadable, cut short (a GGUF's struct.error), or rejected by a validator
        what = Path(source.path) / source.gguf_file if source.gguf_file else source.path
        if source.gguf_file:  # its header passed check_gguf: the metadata after it is cut short or corrupt
            raise ConfigError(f"cannot read the GGUF metadata of {what} ({first_line(err)}); the file may be truncated "
                              "or corrupt: copy or download it again") from None
        raise ConfigError(f"cannot read the model config of {what} ({first_line(err)}); check model.hub_id or model.path, "
                          "or set model.architecture") from None


def infer_family(config: Any) -> str:
    """causal or masked, from the config's ``architectures`` (e.g. Gemma3ForCausalLM, RobertaForMaskedLM), else
    from which auto class knows its model_type (an encoder that both know, as BERT, is masked unless a decoder)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    for name in getattr(config, "architectures", None) or []:
        if name.endswith("ForMaskedLM"):
            return MASKED.name
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return CAUSAL.name
    causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if masked and not (causal and getattr(config, "is_decoder", False)):
        return MASKED.name
    if causal:
        return CAUSAL.name
    raise ConfigError(f"model_type={config.model_type!r} is neither a causal nor a masked LM in this transformers "
                      "version; set model.family=causal or masked if it is one")


def complete_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its ``architecture`` block and ``family`` read from the model's own config when not given."""
    if cfg.architecture and cfg.family:
        return cfg
    config = architecture_config(cfg) if cfg.architecture else source_config(cfg)
    architecture = cfg.architecture or {"model_type": config.model_type, **config.to_diff_dict()}
    return dataclasses.replace(cfg, architecture=architecture, family=cfg.family or infer_family(config))


def architecture_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The sizes a reader checks first: model_type, hidden, intermediate, layers, heads, vocabulary."""
    from adazeta.adapters.sites import mlp_sizes, model_linears

    config = architecture_config(cfg)
    try:
        intermediate = mlp_sizes(config, model_linears(build_meta_model(cfg)) if cfg.family else None)[1]
    except ConfigError:
        intermediate = None
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
    }


def _auto_class(family: str) -> Any:
    import transformers

    return getattr(transformers, as_family(family).auto_class)


def build_meta_model(cfg: ModelConfig) -> nn.Module:
    """The model's architecture on the ``meta`` device: shapes and counts, no memory, no download."""
    if not cfg.architecture:
        raise ConfigError(f"model {cfg.name!r} has no `architecture` block, which a dry run needs")
    config = architecture_config(cfg)
    with torch.device("meta"):
        return _auto_class(cfg.family).from_config(config, dtype=cfg.torch_dtype)


def load_model(cfg: ModelConfig, seed: int = 0) -> LoadedModel:
    """Load model and tokenizer from the resolved source, frozen, in eval mode, on the chosen device."""
    from transformers import AutoTokenizer

    source = resolve_source(cfg)
    device = resolve_device(cfg.device)
    auto = _auto_class(cfg.family)
    spread = {"device_map": cfg.device_map} if cfg.device_map else {}
    if source.kind == "random":
        tokenizer = byte_tokenizer()
        config = architecture_config(cfg, vocab_size=len(tokenizer))
        config.pad_token_id = tokenizer.pad_token_id
        # Seeded so that a test model is the same in every process.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = auto.from_config(config)
    else:
        if source.kind == "local":
            os.environ["HF_HUB_OFFLINE"] = "1"  # a local run must never reach for the Hub
        kwargs = pretrained_kwargs(cfg, source)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
            model = auto.from_pretrained(source.path, dtype=cfg.torch_dtype, **kwargs, **gguf_dense_kwargs(source),
                                         **spread)
        except Exception as err:  # incl. safetensors' SafetensorError, a GGUF's struct.error, torch's unpickling
            if source.kind != "local":
                if isinstance(err, OSError):  # transformers' word for a Hub that cannot be reached or has no such repo
                    raise ConfigError(f"cannot load model {source.path} from the Hugging Face Hub ({first_line(err)}); "
                                      "check the name and the connection, or run from a local copy: "
                                      f"model.model_dir=<folder> or {MODEL_DIR_ENV}") from None
                raise
            # A local file that passed the header checks but cannot be read: truncated or corrupt contents.
            what = Path(source.path) / (source.gguf_file or "")
            raise ConfigError(f"cannot load the model from {what} ({first_line(err)}); the file may "
                              "be truncated or corrupt: copy or download it again") from None
    if source.gguf_file:
        plain_gguf_model_(model, source.gguf_file)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ConfigError(f"the tokenizer of {source.path} has {len(tokenizer)} tokens but the model's embedding only "
                          f"{rows} rows: they do not belong together; save the model with its own tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    if cfg.device_map:
        if source.kind == "random":
            model = dispatch(model.to(cfg.torch_dtype), cfg.device_map)
        device = model.get_input_embeddings().weight.device  # where the inputs go; accelerate moves the rest
    else:
        model.to(device=device, dtype=cfg.torch_dtype)
    model.eval()  # dropout off; first-order methods switch to train() themselves
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, cfg.family, source, device)


def gguf_dense_kwargs(source: ModelSource) -> dict[str, Any]:
    """``from_pretrained``'s ``quantization_config`` for a GGUF source: every weight unpacked to a dense float tensor
    (transformers 5 can keep some architectures' weights in GGUF blocks, which ZO perturbations cannot move and
    ``save_pretrained`` cannot write). Empty for other sources, and where transformers has no ``GgufConfig`` (4.x
    always dequantises)."""
    if not source.gguf_file:
        return {}
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def plain_gguf_model_(model: nn.Module, gguf_file: str | None = None) -> nn.Module:
    """Clear the "quantised with gguf" mark of a model transformers read from a GGUF file and dequantised.

    Such a model holds ordinary float weights, yet transformers keeps its GGUF quantiser on it (``hf_quantizer``,
    ``is_quantized``, ``quantization_method``, ``config.quantization_config``): ``save_pretrained`` then refuses it as
    not serialisable and ``Trainer`` as a quantised model that cannot train. Once cleared it saves and trains as the
    float model it is. Where it came from stays recorded: ``model.gguf_file`` names the file (``gguf_file``, else the
    quantiser's), as a run's ``model_source`` does. A model whose weights are still GGUF blocks (not dequantised) is
    refused in one line. A model without the mark is left as it is (``gguf_file`` still recorded). Returns ``model``.
    """
    from transformers import PreTrainedModel

    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        settings = getattr(getattr(module, "hf_quantizer", None), "quantization_config", None)
        method = getattr(settings, "quant_method", None)
        if str(getattr(method, "value", method)) != "gguf":
            continue
        read_from = gguf_file or getattr(settings, "gguf_file", None)
        packed = [n for n, p in module.named_parameters() if not p.is_floating_point()]
        if packed:
            raise ConfigError(f"the model read from {read_from or 'a GGUF file'} keeps {len(packed)} of its weights "
                              f"in GGUF blocks (e.g. {packed[0]}), which cannot train or be saved; load it with "
                              "from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))")
        for name in ("hf_quantizer", "quantization_method"):
            if name in vars(module):
                delattr(module, name)
        module.is_quantized = False
        if hasattr(module.config, "quantization_config"):
            del module.config.quantization_config
        if getattr(module.config, "_is_quantized", False):
            module.config._is_quantized = False
        module.gguf_file = Path(str(read_from)).name if read_from else None
    if gguf_file and isinstance(model, PreTrainedModel):
        model.gguf_file = Path(str(gguf_file)).name
    return model


def dispatch(model: nn.Module, device_map: str) -> nn.Module:
    """accelerate's dispatch of an in-memory model over the visible GPUs (CPU when there is none or it is full)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None) or []
    max_memory = None
    if device_map != "sequential":
        max_memory = get_balanced_memory(model, no_split_module_classes=no_split,
                                         low_zero=device_map == "balanced_low_0")
    placement = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    return dispatch_model(model, device_map=placement)


def device_map_of(model: nn.Module) -> dict[str, str]:
    """Module name -> device, as accelerate placed the model (empty when it sits on one device)."""
    placed = getattr(model, "hf_device_map", None)
    return {k: str(v) for k, v in placed.items()} if placed else {}


def enable_gradient_checkpointing_(model: nn.Module) -> None:
    """Recompute each layer's activations in backward instead of keeping them (``train.gradient_checkpointing``).

    Set on the transformers model inside the adapter's wrapping (peft's ``PeftModel`` holds it; the TT and
    bottleneck adapters change it in place), so that each of its layers runs under ``torch.utils.checkpoint`` in
    training mode; evaluation (``model.eval()``) runs as before. Non-reentrant checkpointing takes gradients to the
    trainable parameters inside a layer even when the layer's input needs none (frozen embeddings), and recomputes
    with the forward's RNG state (the same dropout masks), so a step's update is the uncheckpointed one up to
    rounding.
    """
    from transformers import PreTrainedModel

    backbone = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if backbone is None or not backbone.supports_gradient_checkpointing:
        raise ConfigError(f"train.gradient_checkpointing=true: {type(backbone or model).__name__} does not support "
                          "gradient checkpointing; set train.gradient_checkpointing=false")
    # transformers 5 renamed the method (the old name warns, and goes in v6); older versions have only the old name.
    enable = getattr(backbone, "activation_checkpointing_enable", None) or backbone.gradient_checkpointing_enable
    enable({"use_reentrant": False})


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; tied weights are counted once."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable
