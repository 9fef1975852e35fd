"""A library's architecture as a model by name, no factory: ``--model hf:Qwen2ForCausalLM``.

The model is built tiny and random-initialised from the library's own config class (small
widths and depths, dropout on wherever the config has a knob for it, no download); the
batch is what its main input asks for (token ids, pixel values, a waveform or feature
frames), with labels, so the loss is the one its head defines; and the segments are what
the library's own toggle checkpoints: transformers wraps every
``GradientCheckpointingLayer``, so every instance of that class (outermost) is a segment.
``hf:path/to/config.json`` shrinks a user's own config the same way, its switches kept.
``--impl hf`` then turns the library's checkpointing on the way its users do. What cannot
be built this way is a usage error with the reason.
"""

from __future__ import annotations

import functools
import importlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models.library_import import import_library
from gradequiv.models.user_model import UserModel

__all__ = ["LIBRARY_PREFIXES", "import_transformers", "library_factory", "transformers_model"]

#: ``--model PREFIX:NAME`` routes to a library's architecture instead of a factory.
LIBRARY_PREFIXES = ("hf", "diffusers", "timm")

BATCH, SEQ, LABELS_SEQ, IMAGE = 2, 8, 6, 32
#: Waveform samples (``input_values``): 12 frames after a wav2vec2-style feature encoder
#: (a 400-sample receptive field, stride 320); feature frames (``input_features``).
AUDIO, FRAMES = 4000, 32

#: Config knobs set where the config has them: two layers, 32 wide, two heads, one
#: key-value head, 64 wide feed-forward, a small vocabulary and image.
SMALL: dict[str, Any] = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "dim": 32, "hidden_dim": 64,
    "num_hidden_layers": 2, "num_layers": 2, "n_layer": 2, "n_layers": 2,
    "num_decoder_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "num_heads": 2, "num_key_value_heads": 1,
    "intermediate_size": 64, "d_ff": 64, "n_inner": 64, "ffn_dim": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "d_kv": 16, "head_dim": 16,
    "vocab_size": 96, "max_position_embeddings": 64, "n_positions": 64,
    "image_size": IMAGE, "patch_size": 8, "num_channels": 3,
    # speech: 16 mel bins over FRAMES frames (Whisper's encoder takes twice its positions)
    "num_mel_bins": 16, "max_source_positions": FRAMES // 2,
}

#: Off where the config has them: SpecAugment's time and feature masks are drawn from
#: numpy's global generator, which no path seeds, so two full-storage runs would differ.
AUGMENT_OFF: dict[str, Any] = {
    "apply_spec_augment": False, "mask_time_prob": 0.0, "mask_feature_prob": 0.0,
}

#: Dropout knobs turned on (0.1) where the config has them: a re-run must draw the same.
DROPOUT = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout",
           "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
           "activation_dropout", "dropout_rate")

#: Parameters a model built by the route may have: one of its config's full size (a
#: sub-config the route does not shrink) would take minutes and gigabytes to check.
MAX_PARAMETERS = 10_000_000

#: The heads whose loss a batch of labels defines, by the class name's ending.
_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration",
          "ForSequenceClassification", "ForTokenClassification", "ForImageClassification",
          "ForCTC")


def library_factory(spec: str) -> Callable[[int], UserModel] | None:
    """The factory ``--model spec`` names when it is a library route (None: it is not)."""
    prefix, _, name = spec.partition(":")
    if prefix == "hf":
        return functools.partial(transformers_model, name)
    if prefix == "diffusers":
        from gradequiv.models.diffusers_models import diffusers_model

        return functools.partial(diffusers_model, name)
    if prefix == "timm":
        from gradequiv.models.timm_models import timm_model

        return functools.partial(timm_model, name)
    return None


def import_transformers(route: str) -> Any:
    """transformers, imported quietly; its absence is a usage error naming ``route``."""
    return import_library("transformers", f"--model {route}", "hf")


def _architecture(transformers: Any, name: str) -> Any:
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "config_class"):
        raise InvalidArgument(
            f"--model='hf:{name}': transformers {transformers.__version__} has no model class "
            f"{name!r}; name one with a head, e.g. hf:Qwen2ForCausalLM, hf:BertForMaskedLM, "
            f"hf:T5ForConditionalGeneration, hf:ViTForImageClassification")
    if not name.endswith(_HEADS):
        raise InvalidArgument(
            f"--model='hf:{name}': gradequiv takes the loss from the model's head, and "
            f"{name} has none it knows; name the class with a head ({', '.join(_HEADS)})")
    if not getattr(cls, "supports_gradient_checkpointing", False):
        raise InvalidArgument(f"--model='hf:{name}': transformers does not support gradient "
                              f"checkpointing for {name} (supports_gradient_checkpointing "
                              f"is False): there is nothing of its own to check")
    return cls


def tiny_config(config_class: Any, *, nested: bool = False,
                base: dict[str, Any] | None = None) -> Any:
    """The architecture's own config, shrunk: the knobs of ``SMALL`` it has, dropout on,
    eager attention, no cache, and special token ids inside the small vocabulary.
    ``nested``: its sub-configs (a multimodal model's ``text_config``, ``vision_config``)
    shrunk the same way too. ``base``: a user's own config (its fields), whose switches
    (activation, positions, norms, tied embeddings) stay as they are; only sizes shrink."""
    given = dict(base or {})
    default = config_class(**given)
    knobs = _small_knobs(default, nested)
    return config_class(**(given | knobs), attn_implementation="eager", use_cache=False)


#: Fields of a saved config that say where it came from or how to load weights, not what
#: the architecture is: left out when a user's config.json is shrunk.
_NOT_ARCHITECTURE = ("architectures", "model_type", "transformers_version", "_name_or_path",
                     "auto_map", "quantization_config", "torch_dtype", "dtype",
                     "attn_implementation", "use_cache")


def user_config(spec: str) -> tuple[str, dict[str, Any]]:
    """``hf:path/to/config.json`` (or a folder holding one): the model class its
    ``architectures`` names, and its fields; a usage error where it cannot be read."""
    path = Path(spec)
    file = path / "config.json" if path.is_dir() else path
    try:
        fields = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"--model='hf:{spec}': cannot read {file} as a transformers "
                              f"config ({type(exc).__name__}: {exc})") from exc
    names = fields.get("architectures") if isinstance(fields, dict) else None
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        raise InvalidArgument(
            f"--model='hf:{spec}': {file} names no model class in 'architectures' (a config "
            f"saved by save_pretrained does); add one, e.g. \"architectures\": "
            f"[\"LlamaForCausalLM\"]")
    return names[0], {k: v for k, v in fields.items() if k not in _NOT_ARCHITECTURE}


def _is_config_path(name: str) -> bool:
    return name.endswith(".json") or "/" in name or Path(name).is_dir()


def _small_knobs(default: Any, nested: bool) -> dict[str, Any]:
    """The knobs that shrink ``default`` (a config), and its sub-configs' where ``nested``."""
    knobs = {k: v for k, v in SMALL.items() if hasattr(default, k)}
    knobs |= {k: v for k, v in AUGMENT_OFF.items() if hasattr(default, k)}
    conv = getattr(default, "conv_dim", None)  # a waveform encoder's convolution widths
    if isinstance(conv, (tuple, list)):
        knobs["conv_dim"] = tuple(16 for _ in conv)
    if getattr(default, "num_conv_pos_embeddings", 0) > 16:  # its positional kernel
        knobs["num_conv_pos_embeddings"] = 16
    knobs |= {k: 0.1 for k in DROPOUT if isinstance(getattr(default, k, None), float)}
    vocab = knobs.get("vocab_size", getattr(default, "vocab_size", None))
    if isinstance(vocab, int):
        for key, value in vars(default).items():
            if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
                knobs[key] = vocab - 1
        if getattr(default, "pad_token_id", 0) is None:
            knobs["pad_token_id"] = 0  # a decoder's classification head finds the last token
    if getattr(default, "is_encoder_decoder", False) and \
            getattr(default, "decoder_start_token_id", None) is None:
        # labels are shifted right into decoder inputs from this id (T5 keeps it elsewhere)
        knobs["decoder_start_token_id"] = knobs.get("pad_token_id", default.pad_token_id or 0)
    if nested:
        for key in getattr(default, "sub_configs", {}):
            inner = getattr(default, key, None)
            if inner is not None and hasattr(inner, "to_dict"):
                given = {k: v for k, v in inner.to_dict().items() if k != "layer_types"}
                knobs[key] = given | _small_knobs(inner, nested)  # layer types: per layer
    return knobs


def _too_large(cls: Any, config: Any) -> str:
    """Why ``cls(config)`` is no tiny model ("" where it is): its parameters counted on the
    meta device, which allocates nothing."""
    with torch.device("meta"):
        count = sum(p.numel() for p in cls(config).parameters())
    if count <= MAX_PARAMETERS:
        return ""
    return (f"{count:,} parameters as the route builds it, more than a tiny model's "
            f"{MAX_PARAMETERS:,}: a size the route does not shrink")


def _batch(cls: Any, name: str, config: Any, seed: int) -> dict[str, Tensor | None]:
    """What the model's main input asks for, with labels its head takes a loss from."""
    gen = torch.Generator().manual_seed(seed)
    main = getattr(cls, "main_input_name", "input_ids")
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(config, "get_text_config"):  # a multimodal model's text
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    if main == "input_ids" and isinstance(vocab, int):
        tokens = torch.randint(4, vocab, (BATCH, SEQ), generator=gen)  # no special ids
        inputs: dict[str, Tensor | None] = {"input_ids": tokens}
        if name.endswith("ForConditionalGeneration") and config.is_encoder_decoder:
            labels = torch.randint(4, vocab, (BATCH, LABELS_SEQ), generator=gen)
        elif name.endswith("ForSequenceClassification"):
            labels = torch.randint(0, config.num_labels, (BATCH,), generator=gen)
        elif name.endswith("ForTokenClassification"):
            labels = torch.randint(0, config.num_labels, (BATCH, SEQ), generator=gen)
        else:  # a language-model head (a multimodal decoder's too): the tokens themselves
            labels = tokens.clone()
        return inputs | {"labels": labels}
    if main in ("input_values", "input_features"):
        return _speech_batch(name, config, main, gen)
    if main == "pixel_values" and name.endswith("ForImageClassification"):
        size = getattr(config, "image_size", IMAGE)
        size = size if isinstance(size, int) else IMAGE
        channels = getattr(config, "num_channels", 3)
        pixels = torch.randn(BATCH, channels, size, size, generator=gen)
        return {"pixel_values": pixels,
                "labels": torch.randint(0, config.num_labels, (BATCH,), generator=gen)}
    raise InvalidArgument(
        f"--model='hf:{name}': its main input is {main!r}, for which gradequiv makes no "
        f"batch yet (token ids, pixel values, waveforms and feature frames it makes); write "
        f"a factory (docs/reference.md, 'Your own model')")


def _speech_batch(name: str, config: Any, main: str, gen: torch.Generator
                  ) -> dict[str, Tensor | None]:
    """A waveform (``input_values``) or feature frames (``input_features``: mel bins by
    frames for Whisper, frames by features for the others), with its head's labels."""
    if main == "input_values":
        audio = torch.randn(BATCH, AUDIO, generator=gen)
    elif hasattr(config, "num_mel_bins"):
        audio = torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions,
                            generator=gen)
    else:
        width = getattr(config, "feature_projection_input_dim", None) or \
            getattr(config, "input_feat_per_channel", 0) * getattr(config, "input_channels", 1)
        if not width:
            raise InvalidArgument(
                f"--model='hf:{name}': its config says no feature width for "
                f"{main!r}; write a factory (docs/reference.md, 'Your own model')")
        audio = torch.randn(BATCH, FRAMES, width, generator=gen)
    vocab = getattr(config, "vocab_size", 2)
    if name.endswith("ForSequenceClassification"):
        labels = torch.randint(0, config.num_labels, (BATCH,), generator=gen)
    elif name.endswith("ForCTC"):  # a transcript shorter than the frames; 0 is the blank
        labels = torch.randint(1, vocab, (BATCH, 4), generator=gen)
    elif name.endswith("ForConditionalGeneration"):  # an encoder-decoder's transcript
        labels = torch.randint(4, vocab, (BATCH, LABELS_SEQ), generator=gen)
    else:
        raise InvalidArgument(
            f"--model='hf:{name}': gradequiv makes no labels for its head from {main!r}; "
            f"write a factory (docs/reference.md, 'Your own model')")
    return {main: audio, "labels": labels}


def _head_loss(outputs: Any, labels: Tensor) -> Tensor:
    """The loss the model's head computed from the labels it was given."""
    loss: Tensor = outputs.loss
    return loss


def transformers_model(name: str, seed: int) -> UserModel:
    """``hf:NAME``: the transformers class ``NAME``, tiny, with its own loss and the layers
    its ``gradient_checkpointing_enable()`` checkpoints as segments."""
    transformers = import_transformers("hf:...")
    base: dict[str, Any] | None = None
    spec = name
    if _is_config_path(name):  # a user's own config, shrunk: hf:path/to/config.json
        name, base = user_config(spec)
    cls = _architecture(transformers, name)
    try:
        layers = importlib.import_module("transformers.modeling_layers")
        checkpointed = layers.GradientCheckpointingLayer
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(
            f"--model='hf:{name}': transformers {transformers.__version__} has no "
            f"GradientCheckpointingLayer (4.52 and later do), which says what its toggle "
            f"checkpoints; upgrade transformers or write a factory") from exc
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = tiny_config(cls.config_class, base=base)
            too_large = _too_large(cls, config)
            if too_large and getattr(config, "sub_configs", None):
                config = tiny_config(cls.config_class, nested=True, base=base)  # all through
                too_large = _too_large(cls, config)
            model = None if too_large else cls(config)
    except Exception as exc:  # a config that cannot be shrunk this way: say which and why
        raise InvalidArgument(
            f"--model='hf:{spec}' could not be built tiny from {cls.config_class.__name__} "
            f"({type(exc).__name__}: {exc}); write a factory with a config of your own "
            f"(docs/reference.md, 'Your own model')") from exc
    if model is None:
        raise InvalidArgument(f"--model='hf:{spec}': {too_large}; write a factory with a "
                              f"config of your own (docs/reference.md, 'Your own model')")
    inputs = _batch(cls, name, config, seed)
    labels = inputs["labels"]
    assert labels is not None
    return UserModel(model, inputs, labels, _head_loss, segments=[checkpointed],
                     regimes=("fp32", "bf16-autocast"))
