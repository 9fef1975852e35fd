"""A check run's options: validated once, the same from argparse and from the plugin, and
whole across a process boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradequiv.harness.cli import build_parser, options_from_args
from gradequiv.harness.errors import InvalidArgument
from gradequiv.harness.options import CheckOptions, check_options
from gradequiv.harness.validate import boolean, impl_kwargs, shard, whole_number


def _from_command_line(*args: str) -> CheckOptions:
    return options_from_args(build_parser().parse_args(["check", *args]))


def test_argparse_and_the_plugins_raw_values_give_the_same_options() -> None:
    from_cli = _from_command_line(
        "--impl", "torch", "--impl-kwarg", "preserve_rng_state=false", "--seed", "7",
        "--examples", "3", "--shard", "2/4", "--rtol", "1e-5", "--report-dir", "out",
        "--no-shrink", "--profile", "dev")
    from_plugin = check_options(
        impl="torch", impl_kwargs="preserve_rng_state=false", seed="7", examples="3",
        shard="2/4", rtol="1e-5", report_dir="out", shrink=False, profile="dev",
        flag=lambda name: f"--gradequiv-{name}")
    assert from_cli == from_plugin
    assert (from_cli.impl, from_cli.seed, from_cli.examples, from_cli.rtol, from_cli.atol,
            from_cli.shrink, from_cli.profile) == ("torch", 7, 3, 1e-5, None, False, "dev")
    assert from_cli.kwargs == {"preserve_rng_state": False}
    assert from_cli.shard == (2, 4) and from_cli.report_dir == Path("out")
    assert from_cli.max_examples == 1  # 3 examples over 4 shards, rounded up


def test_options_cross_a_process_boundary_whole() -> None:
    options = check_options(impl="mod:fn", impl_kwargs=["policy='all'", "k=3"], seed=11,
                            models=["transformer", "batchnorm"], shard=(3, 3), atol=0.5,
                            report_dir="r", deterministic=True, case='{"dtype": "fp32"}')
    again = CheckOptions.from_json(options.to_json())
    assert again == options and again.kwargs == {"policy": "all", "k": 3}
    assert again.deterministic and again.models == ("transformer", "batchnorm")
    assert again.shard == (3, 3) and again.draw_seed == 11 + 2 * 1_000_003


@pytest.mark.parametrize("field, value, message", [
    ("seed", "-1", "--gradequiv-seed=-1: must be at least 0"),
    ("seed", str(2**64), "must be at most"),
    ("examples", "0", "--gradequiv-examples=0: must be at least 1"),
    ("examples", "many", "--gradequiv-examples='many' is not a whole number"),
    ("profile", "fast", "--gradequiv-profile='fast' is not one of ci, dev, thorough"),
    ("device", "tpu", "--gradequiv-device='tpu' is not one of auto, cpu, cuda"),
    ("models", "resnet", "--gradequiv-models='resnet' is not one of"),
    ("shard", "0/2", "--gradequiv-shard='0/2' is not I/N"),
    ("rtol", "-1", "--gradequiv-rtol=-1.0: must be a finite number >= 0"),
    ("atol", "inf", "must be a finite number >= 0"),
    ("adapter", "decorator", "--gradequiv-adapter='decorator' is not one of"),
    ("impl_kwargs", ["novalue"], "--gradequiv-impl-kwarg='novalue' is not KEY=VALUE"),
])
def test_a_bad_value_names_the_option_and_the_rule(field: str, value: object,
                                                   message: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        check_options(flag=lambda name: "--gradequiv-" + name.replace("_", "-"),
                      **{field: value})  # type: ignore[arg-type]
    assert message in str(raised.value)


def test_booleans_are_strict() -> None:
    assert boolean("--x", "False") is False and boolean("--x", "yes") is True
    with pytest.raises(InvalidArgument, match="--x='maybe' is not true or false"):
        boolean("--x", "maybe")


def test_the_validators_return_typed_values() -> None:
    assert whole_number("--n", " 12 ") == 12
    assert shard("--s", "1/1") == (1, 1)
    assert impl_kwargs(["a=none", "b=(1, 2)", "c=word"]) == {"a": None, "b": (1, 2),
                                                            "c": "word"}
    with pytest.raises(InvalidArgument):
        whole_number("--n", True)


def test_check_hands_the_suite_its_options_and_implementation_not_strings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import pytest as pytest_module

    from gradequiv.harness.cli import main
    from gradequiv.harness.options import SuiteRun

    seen: dict[str, object] = {}

    def fake_main(args: list[str], plugins: list[object]) -> int:
        seen["args"], seen["plugins"] = args, plugins
        return 0

    monkeypatch.setattr(pytest_module, "main", fake_main)
    assert main(["check", "--in-process", "--impl", "torch", "--seed", "5", "--impl-kwarg",
                 "preserve_rng_state=true"]) == 0
    assert not [a for a in seen["args"] if str(a).startswith("--gradequiv")]  # type: ignore[attr-defined]
    (run,) = seen["plugins"]  # type: ignore[misc]
    assert isinstance(run, SuiteRun) and run.options.seed == 5
    assert run.implementation.spec == "torch"
    assert run.implementation.kwargs == {"preserve_rng_state": True}
    assert run.options.device in ("cpu", "cuda")  # "auto" resolved once, here
