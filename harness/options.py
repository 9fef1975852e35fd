"""The options of one ``check`` run: one object, validated once, handed on whole.

``gradequiv check`` builds it from argparse, the pytest plugin from its own
command line, environment and ini file; either way through :func:`check_options`,
so every rule lives here and in :mod:`gradequiv.harness.validate`. It crosses a
process boundary (xdist workers) as JSON (:meth:`CheckOptions.to_json`), never as
option strings parsed a second time.

Pure Python: the plugin imports this in every pytest run, torch or not.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from gradequiv.harness import validate
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.regime import Regime, stated_regime
from gradequiv.models.kinds import DRAWN_MODELS, TRANSFORMER  # torch-free, as options must be

__all__ = [
    "ADAPTERS",
    "DEVICES",
    "DRAWN_MODELS",
    "PROFILES",
    "PROFILE_EXAMPLES",
    "CheckOptions",
    "PROFILE_GRANULARITIES",
    "ProfileOptions",
    "SuiteRun",
    "check_options",
    "profile_options",
]

#: Examples per property test in each search profile.
PROFILE_EXAMPLES = {"ci": 20, "dev": 50, "thorough": 400}
PROFILES = tuple(PROFILE_EXAMPLES)
DEVICES = ("auto", "cpu", "cuda")
ADAPTERS = ("function", "wrapper", "toggle")


@dataclass(frozen=True)
class CheckOptions:
    """Everything a check run was asked to do; built by :func:`check_options` only."""

    impl: str | None = None
    impl_kwargs: tuple[str, ...] = ()  # KEY=VALUE as given; ``kwargs`` is their meaning
    adapter: str | None = None
    seed: int = 0
    examples: int | None = None  # overrides the profile's count
    profile: str = "dev"
    device: str = "auto"
    report_dir: Path | None = None
    case: str | None = None  # replay one case (JSON, a .json file or a named case)
    rtol: float | None = None  # explicit bounds, replacing the derived ones
    atol: float | None = None
    models: tuple[str, ...] = (TRANSFORMER,)
    shrink: bool = True  # False: report the first failing example as found
    shrink_budget: float | None = None  # seconds a test may shrink its failure (None: no limit)
    shard: tuple[int, int] = (1, 1)  # (i, n): this run is shard i of n, 1-based
    model: str | None = None  # a user's model factory (package.module:attr) instead of ours
    deterministic: bool = False
    #: torch's intra-op threads for the run (None: torch's default). One: the suite's tiny
    #: tensors gain nothing from more, and lose much beside other jobs on the same cores.
    threads: int | None = 1
    #: what the user's training runs (``harness/regime.py``): cases are drawn within it
    regime: Regime = field(default_factory=Regime)
    kwargs: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def max_examples(self) -> int:
        """Examples per property test for this shard: its share of the run's count."""
        total = self.examples if self.examples is not None else PROFILE_EXAMPLES[self.profile]
        return -(-total // self.shard[1])

    @property
    def draw_seed(self) -> int:
        """The seed Hypothesis draws with: the run's seed, moved apart for each shard so that
        shards draw different cases."""
        index, count = self.shard
        return self.seed if count == 1 else self.seed + 1_000_003 * (index - 1)

    def in_shard(self, position: int) -> bool:
        """Whether the named case at ``position`` of the fixed spread runs on this shard."""
        index, count = self.shard
        return position % count == index - 1

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("kwargs")
        data["report_dir"] = None if self.report_dir is None else str(self.report_dir)
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> CheckOptions:
        data = json.loads(text)
        known = {f.name for f in fields(cls)} - {"kwargs"}
        return check_options(**{k: v for k, v in data.items() if k in known})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_options(
    *,
    flag: Callable[[str], str] = _flag,
    impl: str | None = None,
    impl_kwargs: Any = (),
    adapter: str | None = None,
    seed: Any = 0,
    examples: Any = None,
    profile: str = "dev",
    device: str | None = "auto",
    report_dir: Any = None,
    case: str | None = None,
    rtol: Any = None,
    atol: Any = None,
    models: Any = (TRANSFORMER,),
    shrink: Any = True,
    shrink_budget: Any = None,
    shard: Any = (1, 1),
    model: str | None = None,
    deterministic: Any = False,
    threads: Any = 1,
    regime: Any = None,
    read_pyproject: bool = True,
) -> CheckOptions:
    """Validate raw option values (strings from a command line, or typed) into the options.

    ``flag`` names an option in messages (``--seed`` for the command line,
    ``--gradequiv-seed`` for the plugin). ``regime``: what ``--regime`` gave (or the API's
    mapping), on top of ``[tool.gradequiv]`` of the nearest pyproject.toml where
    ``read_pyproject``. Raises :class:`InvalidArgument`.
    """
    if isinstance(impl_kwargs, str):
        impl_kwargs = impl_kwargs.split()
    kwargs_given = tuple(str(item) for item in impl_kwargs or ())
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    if isinstance(shard, (list, tuple)):
        shard = f"{shard[0]}/{shard[1]}"
    if impl is not None and not str(impl).strip():
        raise InvalidArgument(f"{flag('impl')}={impl!r} is empty; name a built-in (e.g. torch) "
                              f"or a 'module:attr' reference")
    return CheckOptions(
        impl=impl,
        impl_kwargs=kwargs_given,
        adapter=None if adapter is None else validate.choice(flag("adapter"), adapter, ADAPTERS),
        seed=validate.seed(flag("seed"), seed),
        examples=None if examples is None else validate.whole_number(flag("examples"), examples),
        profile=validate.choice(flag("profile"), profile, PROFILES),
        device=validate.choice(flag("device"), device or "auto", DEVICES),
        report_dir=None if report_dir in (None, "") else Path(report_dir),
        case=case,
        rtol=None if rtol is None else validate.bound(flag("rtol"), rtol),
        atol=None if atol is None else validate.bound(flag("atol"), atol),
        models=tuple(validate.choice(flag("models"), m, DRAWN_MODELS) for m in models),
        shrink=validate.boolean("shrink", shrink),
        shrink_budget=None if shrink_budget in (None, "") else validate.bound(
            flag("shrink_budget"), shrink_budget),
        shard=validate.shard(flag("shard"), shard),
        model=model,
        deterministic=validate.boolean(flag("deterministic"), deterministic),
        threads=validate.threads(flag("threads"), threads),
        regime=stated_regime(regime, flag=flag("regime"), read_pyproject=read_pyproject),
        kwargs=validate.impl_kwargs(kwargs_given, name=flag("impl-kwarg")),
    )


@dataclass(eq=False)  # a plugin object: pluggy keeps plugins in sets, by identity
class SuiteRun:
    """What a command hands the property suite: the options, and the implementation already
    resolved (None: the plugin resolves ``options.impl`` itself, once).

    Passed to ``pytest.main(plugins=[...])``; the plugin finds it there. It has no
    hooks of its own.
    """

    options: CheckOptions
    implementation: Any = None
    #: watches the run from outside (``properties.runtime.RunObserver``), or None
    observer: Any = None


#: ``profile``'s granularities when none are given: the transformer's, and a user's model's
#: (its own segments: all, every second, none).
PROFILE_GRANULARITIES = ("none", "layer", "every:2", "group:2", "attention", "mlp")
PROFILE_MODEL_GRANULARITIES = ("none", "layer", "every:2")


@dataclass(frozen=True)
class ProfileOptions:
    """What ``profile`` was asked beyond the model's shape; built by :func:`profile_options`."""

    granularity: tuple[str, ...]  # items as written: parsed against the model once it is built
    memory_budget: int | None = None  # activation bytes a step may hold at its peak
    model: str | None = None  # a user's model factory (package.module:attr)


def profile_options(*, flag: Callable[[str], str] = _flag, granularity: str | None = None,
                    memory_budget: Any = None, model: str | None = None) -> ProfileOptions:
    """Validate ``profile``'s options (raises :class:`InvalidArgument`)."""
    items: tuple[str, ...]
    if granularity is None:
        items = PROFILE_MODEL_GRANULARITIES if model is not None else PROFILE_GRANULARITIES
    else:
        items = tuple(t.strip() for t in granularity.split(",") if t.strip())
        if not items:
            raise InvalidArgument(f"{flag('granularity')}={granularity!r} names none; "
                                  f"write e.g. none,layer,every:2")
    if model is not None and not str(model).strip():
        raise InvalidArgument(f"{flag('model')}={model!r} is empty; name a factory as "
                              f"package.module:attr")
    return ProfileOptions(
        granularity=items,
        memory_budget=None if memory_budget in (None, "") else validate.byte_count(
            flag("memory_budget"), memory_budget),
        model=model)
