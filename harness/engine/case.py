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
    ACCUMULATED_MICRO_BATCHES,
    BACKWARD_AUTOCAST,
    BATCHNORM,
    EXTERNAL,
    GRAD_MODES,
    INPLACE_OPS,
    MODEL_KINDS,
    RETAIN_GRAPH,
    SCHEDULE_MICRO_BATCHES,
    SCHEDULES,
    TRAINABLE,
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
_SCHEDULE_WORDS = {"gpipe": "GPipe", "gpipe-reverse": "GPipe, backwards reversed",
                   "1f1b": "1F1B (4 in flight)", "summed": "one backward of the summed loss"}
_TRAINABLE_WORDS = {"frozen-layer": "first segment frozen (requires_grad=False)",
                    "adapters": "adapters only train", "changing":
                    "first segment frozen on odd steps only"}
_SHAPE_KNOBS = {"aux_loss": "aux loss", "x0_keyword": "x0 by keyword",
                "running_stats": "running stats", "fp32_last_layer": "last layer autocast off",
                "frozen_first_layer": "first layer under no_grad",
                "nested_inputs": "nested inputs", "inplace_ops": "in-place ops",
                "value_hooks": "value-changing hooks", "outside_params": "outside parameters"}


#: The most optimizer steps a case may take: the trajectory property needs two, and each
#: step runs forward and backward on every path, so thousands would stall the run.
MAX_STEPS = 100
#: The largest seed a case may hold: torch's generators take 64 bits, and a run adds its
#: ``--seed`` (at most ``validate.MAX_SEED``) and one (the training stream) to it.
MAX_CASE_SEED = 2**63 - 1
#: The longest name a case may have: it is printed in every line about the case.
MAX_NAME_CHARS = 200
#: The most each count of a case read from JSON (``--case``, a case file) may be, by its
#: config field: far above any case the suite runs. The run's time grows with each, and
#: check's bound on a case's elements (widths, vocabulary, batch and sequence, which it
#: refuses by what they would allocate) misses these: many thin layers, a layer repeated a
#: million times, groups of a thousand layers.
CASE_BOUNDS: dict[str, dict[str, int]] = {
    "model": {"n_layer": 64, "layer_repeats": 8, "n_head": 256, "ffn_mult": 16,
              "n_classes": 2**16},
    "batch": {},
    "granularity": {"k": 64, "size": 64},  # every:K, group:K
}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    schedule: str = "one"  # how a step drives its micro-batches: SCHEDULES
    backward_passes: int = 1  # the loss split in this many parts, backpropagated in turn
    backward_autocast: bool = False  # the backward inside an autocast block
    trainable: str = "all"  # which parameters train: TRAINABLE

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidArgument(
                f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}; pick one of those"
            )
        if not _whole(self.steps) or self.steps < 2:
            raise InvalidArgument(
                f"steps={self.steps!r}: at least 2 optimizer steps are needed for the "
                f"trajectory property"
            )
        if self.steps > MAX_STEPS:
            raise InvalidArgument(
                f"steps={self.steps!r}: a case may take at most {MAX_STEPS} optimizer steps; "
                f"pick steps from 2 to {MAX_STEPS} (2 checks the trajectory)")
        if not _whole(self.seed) or self.seed < 0:
            raise InvalidArgument(f"seed={self.seed!r}: must be a whole number >= 0")
        if self.seed > MAX_CASE_SEED:
            raise InvalidArgument(
                f"seed={self.seed!r}: must be at most {MAX_CASE_SEED} (2**63 - 1: torch's "
                f"generators take 64 bits); pick a smaller seed")
        if not isinstance(self.name, str) or len(self.name) > MAX_NAME_CHARS:
            shown = repr(self.name) if len(repr(self.name)) <= 60 else repr(self.name)[:56] + "..."
            raise InvalidArgument(
                f"name={shown}: must be a string of at most {MAX_NAME_CHARS} characters; "
                f"shorten it")
        if self.grad_mode not in GRAD_MODES:
            raise InvalidArgument(
                f"grad_mode={self.grad_mode!r} is not one of {', '.join(GRAD_MODES)}"
            )
        if not isinstance(self.inference, bool):
            raise InvalidArgument(f"inference={self.inference!r}: must be true or false")
        self._check_training()
        if (self.grad_mode == "create-graph" and isinstance(self.model, TransformerConfig)
                and self.model.attention == "sdpa"):
            raise InvalidArgument(
                "grad_mode='create-graph' with attention='sdpa': SDPA's fused kernels have no "
                "double backward (derivative for _scaled_dot_product_flash_attention_for_cpu_"
                "backward is not implemented); use attention='manual'"
            )

    def _check_training(self) -> None:
        """The training-loop dimensions: each a known value, and none with what it cannot
        go with."""
        if self.schedule not in SCHEDULES:
            raise InvalidArgument(
                f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.trainable not in TRAINABLE:
            raise InvalidArgument(
                f"trainable={self.trainable!r} is not one of {', '.join(TRAINABLE)}")
        if not isinstance(self.backward_autocast, bool):
            raise InvalidArgument(
                f"backward_autocast={self.backward_autocast!r}: must be true or false")
        if not _whole(self.backward_passes) or not 1 <= self.backward_passes <= 3:
            raise InvalidArgument(
                f"backward_passes={self.backward_passes!r}: must be 1, 2 or 3")
        if self.schedule != "one" and self.grad_mode in ("accumulate", "create-graph"):
            raise InvalidArgument(
                f"schedule={self.schedule!r} with grad_mode={self.grad_mode!r}: a schedule "
                f"has its own micro-batches and one backward each; use grad_mode='backward' "
                f"or 'autograd-grad'")
        if self.backward_passes > 1 and self.grad_mode == "create-graph":
            raise InvalidArgument(
                f"backward_passes={self.backward_passes} with grad_mode='create-graph': a "
                f"gradient penalty backpropagates twice already; use backward_passes=1")
        n = self.micro_batch_count
        if isinstance(self.model, BatchNormConfig) and self.batch.batch_size < 2 * n:
            raise InvalidArgument(
                f"batch_size={self.batch.batch_size} with {n} micro-batches: BatchNorm needs "
                f"2 samples in each of the {n} micro-batches; use batch_size >= {2 * n}")
        if self.trainable == "adapters" and not (isinstance(self.model, TransformerConfig)
                                                 and self.model.value_hooks):
            raise InvalidArgument(
                "trainable='adapters' trains the reference transformer's LoRA pairs only; "
                "it needs model_kind 'transformer' with value_hooks=true")

    def loop_patterns(self) -> dict[str, Case]:
        """Each training-loop pattern the case has (by its declaration name), and the case
        without it: what a failure that needs the pattern is told by."""
        off = {"retain-graph": {"backward_passes": 1},
               "backward-autocast": {"backward_autocast": False}}
        patterns = {}
        for name in self.features():
            if name in off:
                patterns[name] = replace(self, **off[name])  # type: ignore[arg-type]
            elif name == self.schedule:
                patterns[name] = replace(self, schedule="one")
            elif name == self.trainable:
                patterns[name] = replace(self, trainable="all")
        return patterns

    @property
    def micro_batch_count(self) -> int:
        """Micro-batches per optimizer step: the schedule's, 2 under ``accumulate``, else 1."""
        if self.schedule != "one":
            return SCHEDULE_MICRO_BATCHES[self.schedule]
        return ACCUMULATED_MICRO_BATCHES if self.grad_mode == "accumulate" else 1

    @property
    def model_kind(self) -> str:
        return next(kind for kind, config in _CONFIGS.items() if isinstance(self.model, config))

    def features(self) -> tuple[str, ...]:
        """What of ``CASE_FEATURES`` the case has, for ``Implementation.declines``."""
        features = [INPLACE_OPS] if getattr(self.model, "inplace_ops", False) else []
        features += [self.schedule] if self.schedule != "one" else []
        features += [RETAIN_GRAPH] if self.backward_passes > 1 else []
        features += [BACKWARD_AUTOCAST] if self.backward_autocast else []
        features += [self.trainable] if self.trainable != "all" else []
        return tuple(features)

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
            size += f", {m.segment_outputs} outputs" if m.segment_outputs != "plain" else ""
            size += f", MoE top-{m.moe_top_k}" if m.moe_top_k else ""
        return (f"{size}, {self.granularity}, {self.dtype}{self._training()}, {rand}, "
                f"seed {self.seed}")

    def _training(self) -> str:
        """How the steps differ from one ``loss.backward()`` each, for ``describe``."""
        parts = [] if self.grad_mode == "backward" else [_GRAD_MODE_WORDS[self.grad_mode]]
        parts += ["eval and no_grad forwards first"] if self.inference else []
        if self.schedule != "one":
            parts.append(f"{_SCHEDULE_WORDS[self.schedule]} over {self.micro_batch_count} "
                         f"micro-batches")
        parts += [f"{self.backward_passes} backward passes (retain_graph)"
                  ] if self.backward_passes > 1 else []
        parts += ["backward under autocast"] if self.backward_autocast else []
        parts += [_TRAINABLE_WORDS[self.trainable]] if self.trainable != "all" else []
        return "".join(f", {p}" for p in parts)

    @property
    def model_dtype(self) -> torch.dtype | None:
        """The dtype the model is cast to (``bf16-model``), or None: left as built."""
        return MODEL_DTYPES.get(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """The case as JSON data. A user's model runs the batch its factory builds from the
        seed, so its case shows no default batch that nothing runs (only the rows a
        distributed case asks of its ranks)."""
        unused = isinstance(self.model, ExternalConfig) and self.batch == BatchConfig()
        batch = {} if unused else {"batch": asdict(self.batch)}
        return {
            "name": self.name,
            "model_kind": self.model_kind,
            "model": asdict(self.model),
            **batch,
            "granularity": str(self.granularity),
            "dtype": self.dtype,
            "seed": self.seed,
            "steps": self.steps,
            "grad_mode": self.grad_mode,
            "inference": self.inference,
            "schedule": self.schedule,
            "backward_passes": self.backward_passes,
            "backward_autocast": self.backward_autocast,
            "trainable": self.trainable,
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
        text = data.pop("granularity", "layer")
        if not isinstance(text, str):
            raise InvalidArgument(f"granularity={text!r} is not a string; write e.g. "
                                  f"\"granularity\": \"layer\"")
        try:
            model = _CONFIGS[kind](**data.pop("model", {}))
            batch = BatchConfig(**data.pop("batch", {}))
            granularity = parse_granularity(text)
        except TypeError as exc:
            raise InvalidArgument(f"case: {exc}; see the case JSON in report.json") from exc
        for part, config in (("model", model), ("batch", batch), ("granularity", granularity)):
            _check_bounds(part, config)
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
        except (ValueError, RecursionError) as exc:  # a number of 5000 digits; deep nesting
            raise InvalidArgument(f"--case={text[:200]!r} is not valid JSON: "
                                  f"{str(exc)[:200] or type(exc).__name__}") from exc
        if not isinstance(data, dict):
            raise InvalidArgument(f"--case={text!r}: a JSON object is needed")
        return cls.from_dict(data)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The precision regime as a context for forward and loss (backward stays outside
        unless ``backward_autocast``: ``backward_context``)."""
        if not self.dtype.endswith("-autocast"):
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.dtype.startswith("bf16") else torch.float16
        return torch.autocast(device.type, dtype=dtype)

    def backward_context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Where backward runs: outside autocast, or under ``backward_autocast`` inside the
        forward's autocast (bf16 autocast where the forward had none: a re-run must run in
        the forward's state, not in backward's)."""
        if not self.backward_autocast:
            return contextlib.nullcontext()
        if self.dtype.endswith("-autocast"):
            return self.autocast(device)
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def cost(self) -> float:
        """A rough measure of the work the case is, for keeping shrinking on cheap cases:
        layer runs (a tiny model's time is per-op overhead) scaled by the elements they see,
        per micro-batch and backward pass, per step. 0 for a user's model (unknown)."""
        model = self.model
        layers = getattr(model, "n_layer", 0) * getattr(model, "layer_repeats", 1)
        width = getattr(model, "n_embd", getattr(model, "width", 0))
        elements = width * self.batch.batch_size * self.batch.seq_len
        passes = (1 + (self.micro_batch_count - 1) / 2) * (
            2 if self.grad_mode == "create-graph" else 1) * (1 + (self.backward_passes - 1) / 2)
        return layers * (1 + elements / 4096) * passes * self.steps * (1 + self.inference)

    def with_seed_offset(self, offset: int) -> Case:
        return replace(self, seed=self.seed + offset)


def _check_bounds(part: str, config: Any) -> None:
    """Each size of a case's ``part`` (model, batch, granularity) within ``CASE_BOUNDS``,
    and a whole number (not true or false, which JSON and Python take as 1 and 0)."""
    for name, most in CASE_BOUNDS[part].items():
        value = getattr(config, name, None)
        if value is None:
            continue
        if not _whole(value):
            raise InvalidArgument(f"{part}.{name}={value!r}: must be a whole number; write "
                                  f"e.g. {name}: 2")
        if value > most and part == "granularity":
            raise InvalidArgument(f"granularity='{config}': K may be at most {most}; pick "
                                  f"'{config.kind}:K' with K from 1 to {most}")
        if value > most:
            raise InvalidArgument(f"{part}.{name}={value!r}: a case may have at most {most}; "
                                  f"pick a {name} from 1 to {most}")
    momentum = getattr(config, "momentum", 0.1)
    if not (isinstance(momentum, (int, float)) and not isinstance(momentum, bool)
            and 0.0 <= momentum <= 1.0):
        raise InvalidArgument(f"model.momentum={momentum!r}: must be a number from 0 to 1 "
                              f"(BatchNorm's running-statistics momentum); write e.g. "
                              f"momentum: 0.1")
