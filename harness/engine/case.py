"""A case: one model, one fixed batch, one granularity, one dtype regime, one seed.

Cases are plain frozen data with a JSON form, so a failure can be written
into a report and replayed exactly (``gradequiv check --case '<json>'``).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from gradequiv.harness.errors import InvalidArgument
from gradequiv.models import (
    DROPOUT_SITES,
    BatchConfig,
    BatchNormConfig,
    ExternalConfig,
    Granularity,
    ModelConfig,
    TransformerConfig,
    parse_granularity,
)
from gradequiv.models.kinds import (
    BATCHNORM,
    EXTERNAL,
    GRAD_MODES,
    INPLACE_OPS,
    MODEL_KINDS,
    TRANSFORMER,
)
from gradequiv.models.kinds import DTYPES as DTYPES  # the public API names it here

#: The dtype of the weights in each regime that casts the model.
MODEL_DTYPES = {"bf16-model": torch.bfloat16}

_ConfigType = type[TransformerConfig] | type[BatchNormConfig] | type[ExternalConfig]
#: The config class of each model kind (``model_kind`` in a case's JSON).
_CONFIGS: dict[str, _ConfigType] = {
    TRANSFORMER: TransformerConfig,
    BATCHNORM: BatchNormConfig,
    EXTERNAL: ExternalConfig,
}


#: Words for ``describe``: each grad mode but the plain one, each shape knob of the model.
_GRAD_MODE_WORDS = {"autograd-grad": "torch.autograd.grad", "accumulate": "2 micro-batches",
                    "create-graph": "gradient penalty (create_graph)"}
_SHAPE_KNOBS = {"aux_loss": "aux loss", "x0_keyword": "x0 by keyword",
                "running_stats": "running stats", "fp32_last_layer": "last layer autocast off",
                "frozen_first_layer": "first layer under no_grad",
                "nested_inputs": "nested inputs", "inplace_ops": "in-place ops",
                "value_hooks": "value-changing hooks", "outside_params": "outside parameters"}


@dataclass(frozen=True)
class Case:
    model: ModelConfig = field(default_factory=TransformerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    granularity: Granularity = field(default_factory=lambda: parse_granularity("layer"))
    dtype: str = "fp32"
    seed: int = 0
    steps: int = 2  # optimizer steps; the trajectory property needs at least two
    name: str = ""
    grad_mode: str = "backward"  # how each step asks for gradients: GRAD_MODES
    inference: bool = False  # an eval and a no_grad forward before training (``inference``)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgument(
                f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}; pick one of those"
            )
        if not isinstance(self.steps, int) or self.steps < 2:
            raise InvalidArgument(
                f"steps={self.steps!r}: at least 2 optimizer steps are needed for the "
                f"trajectory property"
            )
        if not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgument(f"seed={self.seed!r}: must be a whole number >= 0")
        if self.grad_mode not in GRAD_MODES:
            raise InvalidArgument(
                f"grad_mode={self.grad_mode!r} is not one of {', '.join(GRAD_MODES)}"
            )
        if not isinstance(self.inference, bool):
            raise InvalidArgument(f"inference={self.inference!r}: must be true or false")
        if (self.grad_mode == "create-graph" and isinstance(self.model, TransformerConfig)
                and self.model.attention == "sdpa"):
            raise InvalidArgument(
                "grad_mode='create-graph' with attention='sdpa': SDPA's fused kernels have no "
                "double backward (derivative for _scaled_dot_product_flash_attention_for_cpu_"
                "backward is not implemented); use attention='manual'"
            )
        if (self.grad_mode == "accumulate" and isinstance(self.model, BatchNormConfig)
                and self.batch.batch_size < 4):
            raise InvalidArgument(
                f"batch_size={self.batch.batch_size} with grad_mode='accumulate': BatchNorm "
                f"needs 2 samples in each of the 2 micro-batches; use batch_size >= 4"
            )

    @property
    def model_kind(self) -> str:
        return next(kind for kind, config in _CONFIGS.items() if isinstance(self.model, config))

    def features(self) -> tuple[str, ...]:
        """What of ``CASE_FEATURES`` the case has, for ``Implementation.declines``."""
        return (INPLACE_OPS,) if getattr(self.model, "inplace_ops", False) else ()

    def describe(self) -> str:
        """A short human line: what makes this case this case, random sites included."""
        m = self.model
        if isinstance(m, TransformerConfig):
            size = f"{m.n_layer}L x {m.n_embd}w x {self.batch.seq_len}t"
            sites = [f"{name.removesuffix('_dropout')} {getattr(m, name):g}"
                     for name in DROPOUT_SITES if getattr(m, name) > 0]
            sites += ["rrelu"] if m.activation == "rrelu" else []
        elif isinstance(m, BatchNormConfig):
            size = f"batchnorm {m.n_layer}L x {m.width}w" + (", in-place ops" if m.inplace_ops
                                                                else "")
            sites = [f"dropout {m.dropout:g}"] if m.dropout > 0 else []
        else:
            granularity = ("granularity: the toggle's" if self.granularity.kind == "toggle"
                           else str(self.granularity))
            return (f"model {m.factory}, {granularity}, {self.dtype}{self._training()}, "
                    f"seed {self.seed}")
        rand = f"random: {', '.join(sites)}" if sites else "no random ops"
        if isinstance(m, TransformerConfig):
            size += "".join(f", {label}" for knob, label in _SHAPE_KNOBS.items()
                            if getattr(m, knob))
            size += f", each layer x{m.layer_repeats}" if m.layer_repeats > 1 else ""
        return (f"{size}, {self.granularity}, {self.dtype}{self._training()}, {rand}, "
                f"seed {self.seed}")

    def _training(self) -> str:
        """How the steps differ from one ``loss.backward()`` each, for ``describe``."""
        parts = [] if self.grad_mode == "backward" else [_GRAD_MODE_WORDS[self.grad_mode]]
        parts += ["eval and no_grad forwards first"] if self.inference else []
        return "".join(f", {p}" for p in parts)

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the model is cast to (``bf16-model``), or None: left as built."""
        return MODEL_DTYPES.get(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "model_kind": self.model_kind,
            "model": asdict(self.model),
            "batch": asdict(self.batch),
            "granularity": str(self.granularity),
            "dtype": self.dtype,
            "seed": self.seed,
            "steps": self.steps,
            "grad_mode": self.grad_mode,
            "inference": self.inference,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Case:
        data = dict(data)
        kind = data.pop("model_kind", TRANSFORMER)
        if kind not in _CONFIGS:
            raise InvalidArgument(
                f"model_kind={kind!r} is not one of {', '.join(MODEL_KINDS)}"
            )
        try:
            model = _CONFIGS[kind](**data.pop("model", {}))
            batch = BatchConfig(**data.pop("batch", {}))
            granularity = parse_granularity(data.pop("granularity", "layer"))
        except TypeError as exc:
            raise InvalidArgument(f"case: {exc}; see the case JSON in report.json") from exc
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise InvalidArgument(
                f"case keys {sorted(unknown)} are not known; known keys: "
                f"{', '.join(['model_kind'] + [f.name for f in fields(cls)])}"
            )
        return cls(model=model, batch=batch, granularity=granularity, **data)

    @classmethod
    def from_json(cls, text: str) -> Case:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"--case={text!r} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise InvalidArgument(f"--case={text!r}: a JSON object is needed")
        return cls.from_dict(data)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The precision regime as a context for forward and loss (backward stays outside)."""
        if not self.dtype.endswith("-autocast"):
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.dtype.startswith("bf16") else torch.float16
        return torch.autocast(device.type, dtype=dtype)

    def cost(self) -> float:
        """A rough measure of the work the case is, for keeping shrinking on cheap cases:
        layer runs (a tiny model's time is per-op overhead) scaled by the elements they see,
        per micro-batch and backward pass, per step. 0 for a user's model (unknown)."""
        model = self.model
        layers = getattr(model, "n_layer", 0) * getattr(model, "layer_repeats", 1)
        width = getattr(model, "n_embd", getattr(model, "width", 0))
        elements = width * self.batch.batch_size * self.batch.seq_len
        passes = (2 if self.grad_mode == "accumulate" else 1) * (
            2 if self.grad_mode == "create-graph" else 1)
        return layers * (1 + elements / 4096) * passes * self.steps * (1 + self.inference)

    def with_seed_offset(self, offset: int) -> Case:
        return replace(self, seed=self.seed + offset)
