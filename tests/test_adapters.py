"""SPEC resolution: built-ins, module:attr from the current directory, entry points."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from gradequiv.harness import InvalidArgument, parse_impl_kwargs, resolve
from gradequiv.harness.implementations import resolve as resolve_module
from gradequiv.harness.implementations.torch_builtins import (
    torch_checkpoint,
    torch_reentrant_checkpoint,
)


def test_builtins_resolve_to_torch_checkpoint() -> None:
    assert resolve("torch").target is torch_checkpoint
    assert resolve("torch-reentrant").target is torch_reentrant_checkpoint
    assert resolve("torch").adapter == "function"


def test_a_module_in_the_current_directory_resolves(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_recompute_mod.py").write_text(
        "def ckpt(fn, *a, **k):\n    return fn(*a, **k)\nckpt.gradequiv_adapter = 'function'\n"
        "def wrap(module):\n    return module\nwrap.gradequiv_adapter = 'wrapper'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("my_recompute_mod:ckpt").target.__name__ == "ckpt"
    assert resolve("my_recompute_mod:wrap").adapter == "wrapper"  # declared by the object
    assert resolve("my_recompute_mod:wrap", adapter="function").adapter == "function"


def test_an_entry_point_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="mine", value="wrong_impls:no_op", group="gradequiv.implementations")
    monkeypatch.setattr(resolve_module, "entry_points", lambda group: [ep])
    impl = resolve("mine")
    assert impl.target.__name__ == "no_op" and impl.spec == "mine"


def test_a_broken_entry_point_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = EntryPoint(name="bad", value="nosuch_pkg:impl", group="gradequiv.implementations")
    monkeypatch.setattr(resolve_module, "entry_points", lambda group: [ep])
    with pytest.raises(InvalidArgument, match="entry point 'nosuch_pkg:impl' failed to load"):
        resolve("bad")


def test_impl_kwargs_parse_as_literals() -> None:
    parsed = parse_impl_kwargs(["preserve_rng_state=false", "n=3", "p=0.5", "mode=fast",
                                "debug=True", "policy=None", "ids=[1, 2]"])
    assert parsed == {"preserve_rng_state": False, "n": 3, "p": 0.5, "mode": "fast",
                      "debug": True, "policy": None, "ids": [1, 2]}


@pytest.mark.parametrize("item", ["novalue", "=1", "2x=1", "a b=1"])
def test_malformed_impl_kwargs_are_refused(item: str) -> None:
    with pytest.raises(InvalidArgument, match="is not KEY=VALUE"):
        parse_impl_kwargs([item])


def test_command_args_name_the_implementation_again() -> None:
    impl = resolve("torch", kwargs={"preserve_rng_state": False})
    assert impl.command_args() == ["--impl", "torch", "--impl-kwarg", "preserve_rng_state=false"]
    wrapped = resolve("wrong_impls:CheckpointWrapper", adapter="wrapper")
    assert wrapped.command_args() == ["--impl", "wrong_impls:CheckpointWrapper",
                                      "--adapter", "wrapper"]
