"""The evidence table: every built-in implementation over a few regimes, written as Markdown.

For each implementation and regime (fp32 and CPU bf16 autocast, dropout on
and off, implementation options, inputs without grad, BatchNorm buffers)
one named case of ``gradequiv.harness.engine.spread`` is verified; each row gives
the verdict, the worst relative error, the failing properties, the command
that replays it and, for a failure, where in the library it comes from.

    python ci/implementations.py            # writes docs/implementations.md
    python ci/implementations.py --check    # exit 1 if the doc's verdicts are stale

``--check`` compares verdicts and failing properties only (not errors,
which may move with threads or CPU), and only for implementations whose
library is installed here, unless the doc says one is not installed and it
now is: then the doc is stale too.
"""

from __future__ import annotations

import argparse
import platform
import re
import shlex
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from gradequiv.harness import Case, resolve, verify
from gradequiv.harness.engine.spread import load_case
from gradequiv.harness.implementations.libraries import EXTRAS
from gradequiv.models import ExternalConfig, InvalidArgument

DOC = Path(__file__).resolve().parent.parent / "docs" / "implementations.md"

_DROPOUT = "2L-layer-manual-attn"
#: (label, case name, implementation kwargs) run for every implementation
COMMON = [
    ("fp32, no dropout", "2L-layer-nodropout", {}),
    ("fp32, dropout at every site", _DROPOUT, {}),
    ("fp32, SDPA dropout, attention only", "2L-attention-sdpa-dropout", {}),
    ("bf16 autocast, no dropout", "2L-layer-bf16-nodropout", {}),
    ("bf16 autocast, dropout", "2L-layer-bf16-dropout", {}),
    ("fp16 autocast, dropout", "2L-layer-fp16-dropout", {}),
    ("model in bf16, dropout", "2L-layer-bf16-model-dropout", {}),
    ("torch.autograd.grad, dropout", "2L-layer-autograd-grad-dropout", {}),
    ("2 micro-batches accumulated, dropout", "2L-layer-accumulate-dropout", {}),
    ("eval and no_grad forwards first, dropout", "2L-layer-inference-first-dropout", {}),
    ("first layer frozen under no_grad, dropout", "2L-layer-frozen-first-layer", {}),
    ("aux loss, each layer twice, x0 by keyword", "2L-layer-aux-shared-x0kw-dropout", {}),
    ("one layer, 128k-element inputs, dropout", "1Lx256x128-layer-dropout-128k", {}),
    ("inputs without grad (frozen embeddings)", "2L-layer-frozen-embeddings", {}),
    ("BatchNorm running statistics", "batchnorm-layer", {}),
    ("nested inputs, none positional, bf16 autocast, dropout",
     "2L-layer-bf16-nested-inputs-dropout", {}),
    ("in-place ops, manual attention, dropout",
     "2L-layer-inplace-ops-manual-attn-relu-dropout", {}),
    ("in-place ops, no biases, manual attention, dropout",
     "2L-layer-inplace-ops-nobias-manual-attn", {}),
    ("value-changing hooks (LoRA, rescale, steering), dropout", "2L-layer-value-hooks-dropout",
     {}),
    ("parameters read from outside the segment, dropout", "2L-layer-outside-params-dropout",
     {}),
]
_NO_RNG = ("preserve_rng_state=false, dropout", _DROPOUT, {"preserve_rng_state": False})
#: rows for one implementation's own options
OPTIONS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {
    "torch": [_NO_RNG],
    "torch-reentrant": [_NO_RNG],
    "torch-sac": [_NO_RNG,
                  ("policy=none, dropout", _DROPOUT, {"policy": "none"}),
                  ("policy=all, no dropout", "2L-layer-nodropout", {"policy": "all"}),
                  ("policy=all, dropout", _DROPOUT, {"policy": "all"})],
    "torch-wrapper": [_NO_RNG,
                      ("reentrant=true, dropout", _DROPOUT, {"reentrant": True}),
                      ("reentrant=true, frozen embeddings", "2L-layer-frozen-embeddings",
                       {"reentrant": True})],
    "fairscale": [("offload_to_cpu=true, dropout", _DROPOUT, {"offload_to_cpu": True})],
}



def _hf(model: str, dtype: str = "fp32") -> str:
    return Case(model=ExternalConfig(f"gradequiv.models.hf:{model}"), dtype=dtype).to_json()


#: transformers' toggle runs on its own models (--model), not on the reference cases
ROWS: dict[str, list[tuple[str, str, dict[str, Any]]]] = {"hf": [
    ("Llama, fp32, attention dropout", _hf("llama"), {}),
    ("Llama, bf16 autocast", _hf("llama", "bf16-autocast"), {}),
    ("GPT-2, fp32, dropout at every site", _hf("gpt2"), {}),
    ("GPT-2, bf16 autocast", _hf("gpt2", "bf16-autocast"), {}),
    ("use_reentrant=true, Llama", _hf("llama"), {"use_reentrant": True}),
    ("preserve_rng_state=false, Llama", _hf("llama"), {"preserve_rng_state": False}),
]}
IMPLEMENTATIONS = ["torch", "torch-reentrant", "torch-sac", "torch-wrapper", "torch-patched",
                   "torch-offload", "torch-offload-wrapper", "fairscale", "deepspeed",
                   "deepspeed-nonreentrant", "megatron", "hf"]
LIBRARIES = {spec: "torch" for spec in IMPLEMENTATIONS if spec.startswith("torch")} | {
    spec: dist for spec, (_, dist) in EXTRAS.items()}

_FAIRSCALE_AUTOCAST = (
    "fairscale/nn/checkpoint/checkpoint_activations.py: `CheckpointFunction.forward` records "
    "`is_autocast_enabled()`, which calls `torch.is_autocast_enabled()` with no device, i.e. "
    "CUDA autocast only; under CPU autocast it records False, and `backward` re-runs the "
    "segment under its `autocast()` helper (`torch.cuda.amp.autocast`) only if True: the "
    "recompute runs in fp32 and its saved activations differ from the bf16 forward's.")
_DEEPSPEED_AUTOCAST = (
    "deepspeed/runtime/activation_checkpointing/checkpointing.py: `CheckpointFunction.backward` "
    "re-runs the segment under `torch.enable_grad()` alone; the forward's autocast state is "
    "never recorded, so the recompute runs in fp32 (torch's checkpoint re-enters the recorded "
    "autocast state).")
_DEEPSPEED_NR_AUTOCAST = (
    "deepspeed/runtime/activation_checkpointing/checkpointing.py: `non_reentrant_checkpoint`'s "
    "`checkpoint_unpack` replays the segment under `torch.enable_grad()` and its "
    "`saved_tensors_hooks(replay_pack, ...)` without the forward's autocast state, so fp32 "
    "activations stand in for the bf16 ones autograd saved and the first matmul backward "
    "raises on the dtype mismatch (a loud failure, not a silent one).")
_REENTRANT_NO_GRAD = (
    "{where}: reentrant checkpoint is an `autograd.Function`; when no tensor argument requires "
    "grad, its output has no `grad_fn`, backward never reaches it, and the segment's own "
    "parameters get no gradient{warns}.")
_TORCH_WARNS = " (torch warns 'None of the inputs have requires_grad=True')"
_TORCH_BATCHNORM = (
    "torch/utils/checkpoint.py: the recompute re-runs the segment in training mode, so "
    "BatchNorm updates `running_mean`, `running_var` and `num_batches_tracked` a second time. "
    "fairscale's `checkpoint_wrapper` avoids it: it calls `patch_batchnorm` "
    "(fairscale/nn/checkpoint/checkpoint_utils.py), whose hooks turn `track_running_stats` off "
    "during the no-grad first forward, so only the recompute updates them.")
_NO_RNG_WHY = (
    "torch/utils/checkpoint.py: with `preserve_rng_state=False` the recompute draws fresh "
    "dropout masks from wherever the RNG stream is in backward (as documented), and the "
    "caller's stream is left moved by the recompute's draws.")
#: implementation -> what is known although it could not run here
NOT_RUN_WHY = {
    "megatron": (
        "A CPU run would need those two CUDA RNG calls (`_get_cuda_rng_state` and "
        "`_set_cuda_rng_state` in megatron/core/tensor_parallel/random.py) skipped when CUDA "
        "is absent; nothing else in its `CheckpointFunction` needs a GPU. Measured once with a "
        "throwaway script that stubbed exactly those two (not a gradequiv verdict, no command "
        "replays it): fp32 with and without dropout bitwise equal; bf16 autocast fails "
        "gradients and trajectory with the same errors as DeepSpeed's reentrant checkpoint "
        "(`CheckpointFunction.backward` re-runs the segment under `torch.enable_grad()` "
        "without the forward's autocast state); frozen embeddings give the first layer no "
        "gradients (reentrant `autograd.Function`); BatchNorm statistics are updated twice. "
        "Its `checkpoint(function, distribute_saved_activations, *args)` takes no keyword "
        "arguments; the adapter binds them with functools.partial. Not yet run on CUDA."),
}
#: (implementation, label) -> where in the library a failure comes from
WHY: dict[tuple[str, str], str] = {
    ("fairscale", "bf16 autocast, no dropout"): _FAIRSCALE_AUTOCAST,
    ("fairscale", "bf16 autocast, dropout"): _FAIRSCALE_AUTOCAST,
    ("deepspeed", "bf16 autocast, no dropout"): _DEEPSPEED_AUTOCAST,
    ("deepspeed", "bf16 autocast, dropout"): _DEEPSPEED_AUTOCAST,
    ("deepspeed-nonreentrant", "bf16 autocast, no dropout"): _DEEPSPEED_NR_AUTOCAST,
    ("deepspeed-nonreentrant", "bf16 autocast, dropout"): _DEEPSPEED_NR_AUTOCAST,
    ("deepspeed", "inputs without grad (frozen embeddings)"): _REENTRANT_NO_GRAD.format(
        where="deepspeed/runtime/activation_checkpointing/checkpointing.py `checkpoint` -> "
              "`CheckpointFunction.apply`", warns=", silently"),
    ("torch-reentrant", "inputs without grad (frozen embeddings)"): _REENTRANT_NO_GRAD.format(
        where="torch/utils/checkpoint.py `CheckpointFunction`", warns=_TORCH_WARNS),
    ("torch-wrapper", "reentrant=true, frozen embeddings"): _REENTRANT_NO_GRAD.format(
        where="torch/utils/checkpoint.py `CheckpointFunction` (via `CheckpointImpl.REENTRANT`)",
        warns=_TORCH_WARNS),
    ("deepspeed", "BatchNorm running statistics"): (
        "deepspeed/runtime/activation_checkpointing/checkpointing.py: `CheckpointFunction."
        "backward` re-runs the segment in training mode: BatchNorm statistics updated twice."),
    ("deepspeed-nonreentrant", "BatchNorm running statistics"): (
        "deepspeed/runtime/activation_checkpointing/checkpointing.py: `checkpoint_unpack` "
        "re-runs the segment in training mode: BatchNorm statistics updated twice."),
    ("torch-sac", "policy=all, no dropout"): (
        "By design, not a library fault: saving every op's output keeps more than autograd "
        "itself would (outputs no backward formula needs), so more bytes are held than on the "
        "full-storage path; the recompute property reports it for a selective policy."),
    ("torch-sac", "policy=all, dropout"): (
        "torch/utils/checkpoint.py, selective checkpoint's cache: CPU dropout decomposes into "
        "`empty_like` then an in-place `bernoulli_`; a policy that saves `empty_like`'s "
        "output sees the cached tensor mutated and torch refuses in backward ('Tensor cached "
        "during selective activation checkpoint has been mutated'). A loud failure."),
}
for _spec, _note in (("fairscale", _FAIRSCALE_AUTOCAST), ("deepspeed", _DEEPSPEED_AUTOCAST),
                     ("deepspeed-nonreentrant", _DEEPSPEED_NR_AUTOCAST)):
    WHY[(_spec, "fp16 autocast, dropout")] = _note  # the bf16 rows' cause, in fp16
for _spec in IMPLEMENTATIONS:
    if _spec not in ("fairscale",):
        WHY.setdefault((_spec, "BatchNorm running statistics"), _TORCH_BATCHNORM)
for _spec in ("torch", "torch-reentrant", "torch-sac", "torch-wrapper"):
    WHY[(_spec, _NO_RNG[0])] = _NO_RNG_WHY
_NESTED = "nested inputs, none positional, bf16 autocast, dropout"
WHY[("fairscale", _NESTED)] = (
    "fairscale/internal/containers.py: `split_non_tensors` splits the top-level arguments "
    "only; a tuple, list or dict of tensors goes with the non-tensor objects, so "
    "`CheckpointFunction` (fairscale/nn/checkpoint/checkpoint_activations.py) neither makes "
    "its tensors inputs nor detaches them. The recompute runs on the forward's own tensors, "
    "its inner backward runs on into the graph before the segment, and backward through "
    "that graph then raises 'Trying to backward through the graph a second time'.")
WHY[("deepspeed", _NESTED)] = (
    "deepspeed/runtime/activation_checkpointing/checkpointing.py: `detach_variable` and "
    "`CheckpointFunction` take the top-level tensor arguments only; tensors nested in a "
    "tuple, list or dict are read as they are and are no inputs of the Function. With every "
    "tensor nested, no input requires grad: backward never reaches the Function, blocks.0 "
    "is not recomputed, and neither its parameters nor what feeds it through the nested "
    "tensors (`wpe.weight`) get a gradient, silently.")
WHY[("deepspeed-nonreentrant", _NESTED)] = _DEEPSPEED_NR_AUTOCAST
WHY[("torch-sac", "in-place ops, manual attention, dropout")] = (
    "torch/utils/checkpoint.py, selective checkpoint's cache (`_VersionWrapper`): an in-place "
    "op (`ReLU(inplace=True)`, the in-place residual dropout) wrote into a Linear's output "
    "the policy saved (`addmm`, then a view autograd tracks), which moves the saved tensor's "
    "version counter, and torch refuses in backward ('Tensor cached during selective "
    "activation checkpoint has been mutated'). A loud refusal, no wrong gradient: not "
    "applicable. The same model without biases is silently wrong (the next row).")
WHY[("torch-sac", "in-place ops, no biases, manual attention, dropout")] = (
    "torch/utils/checkpoint.py, selective checkpoint's cache: it checks a saved output's "
    "version counter, and only that. `q @ k.transpose(-2, -1)` runs `bmm` then "
    "`_unsafe_view`, and a bias-free `nn.Linear` on a 3-D input runs `mm` then "
    "`_unsafe_view`; `_unsafe_view`'s output shares the saved output's memory but not its "
    "version counter, so the in-place `mul_` (the score scale, an in-place dropout) changes "
    "the saved output unseen and the re-run reads the changed values: silently wrong "
    "gradients. With a bias (`addmm`, then a view autograd tracks) or a 2-D input torch "
    "raises instead (pytorch/pytorch#113737, #119590).")
WHY[("hf", "preserve_rng_state=false, Llama")] = (
    "transformers/modeling_layers.py: `GradientCheckpointingLayer.__call__` hands the layer to "
    "torch's checkpoint with the user's `gradient_checkpointing_kwargs`, so "
    "`preserve_rng_state=False` reaches " + _NO_RNG_WHY)


@dataclass
class Row:
    spec: str
    label: str
    #: PASS, FAIL, N/A (a loud refusal, not applicable), SKIP (a grad mode it declares
    #: unsupported), or "not run"
    verdict: str
    failed: str  # failing properties, comma separated, or the reason it did not run
    worst: str
    first: str
    command: str


def run_rows(spec: str) -> list[Row]:
    """Every regime of one implementation; a library that cannot run gives one 'not run' row."""
    rows = []
    for label, name, kwargs in ROWS.get(spec, COMMON + OPTIONS.get(spec, [])):
        try:
            impl = resolve(spec, kwargs=kwargs)  # checks the library and options here
        except InvalidArgument as exc:
            return [Row(spec, "every regime", "not run", str(exc), "", "", "")]
        command = shlex.join(["gradequiv", "check", *impl.command_args(), "--device", "cpu",
                              "--case", name])
        case = load_case(name)
        if case.grad_mode not in impl.grad_modes:
            rows.append(Row(spec, label, "SKIP", f"declares {case.grad_mode} unsupported",
                            "-", "-", command))
            continue
        verdict = verify(impl, case)
        failed = [p.name for p in verdict.properties if p.passed is False]
        if verdict.error is not None:
            failed = ["raised"]
        checks = [c for p in verdict.properties for c in p.checks]
        worst = max(checks, key=lambda c: c.rel_error, default=None)
        worst_text = "-" if worst is None else (
            "0 (bitwise equal)" if worst.rel_error == 0 else
            f"{worst.rel_error:.3g} ({worst.property})")
        refused = verdict.passed and all(p.passed is None for p in verdict.properties)
        first = verdict.properties[0].summary if refused else verdict.first_failure
        rows.append(Row(spec, label, "N/A" if refused else "PASS" if verdict.passed
                        else "FAIL", ", ".join(failed) or "-", worst_text,
                        _cell(first) or "-", command))
        print(f"{spec:24s} {label:44s} {rows[-1].verdict}", file=sys.stderr, flush=True)
    return rows


def _cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def sections(text: str) -> dict[str, str]:
    """Implementation -> its section of the doc, from its heading to the next one."""
    found: dict[str, str] = {}
    for part in re.split(r"(?m)^(?=## `)", text)[1:]:
        found[part.splitlines()[0][4:].rstrip("`")] = part.rstrip() + "\n"
    return found


def _old_versions(text: str) -> dict[str, str]:
    """Distribution -> the version the doc's conditions line names."""
    line = next((x for x in text.splitlines() if x.startswith("Conditions: ")), "")
    return dict(re.findall(r"([\w-]+) ([\w.+]+)(?:,|;)", line.removeprefix("Conditions: ")))


def render(rows: dict[str, list[Row]], old: str = "") -> str:
    """The doc; an implementation that cannot run here keeps ``old``'s section, and its
    library the version that section was measured with."""
    kept = {spec: text for spec, text in sections(old).items()
            if spec in rows and rows[spec][0].verdict == "not run"}
    measured = _old_versions(old)
    kept_dists = {LIBRARIES[spec] for spec in kept}
    dists = sorted({dist for dist in LIBRARIES.values()})
    versions = ", ".join(
        f"{d} {measured[d] if d in kept_dists and d in measured else _version(d)}"
        for d in dists)
    out = [
        "# What gradequiv finds in the recompute implementations people train with",
        "",
        "Generated by `python ci/implementations.py`; `python ci/implementations.py --check` "
        "(tox env `peers`) fails when these verdicts no longer match the code. Each row is one "
        "named case (`gradequiv check --case NAME` replays it; `hf` rows run transformers' own "
        "tiny models, `--model gradequiv.models.hf:llama` or `:gpt2`): two optimizer steps, every "
        "property. The worst relative error is over every tensor compared, with the property "
        "it belongs to; on CPU a correct recompute is bitwise equal to full storage, so the "
        "bound for an fp32 gradient is 9.5e-7 even under bf16 autocast. N/A: the "
        "implementation refused the case loudly and by design (torch's selective checkpoint's "
        "'has been mutated' error), which is held neither for nor against it.",
        "",
        f"Conditions: {versions}; Python {platform.python_version()}, CPU "
        f"({platform.machine()}), {torch.get_num_threads()} threads, no GPU.",
        "",
    ]
    for spec in IMPLEMENTATIONS:
        if spec in kept:
            out += [kept[spec].rstrip(), ""]
            continue
        out += [f"## `{spec}`", ""]
        first = rows[spec][0]
        if first.verdict == "not run":
            out += [f"Not run here: {first.failed}.", ""]
            out += [NOT_RUN_WHY[spec], ""] if spec in NOT_RUN_WHY else []
            out += [f"<!-- {spec} | not run -->", ""]
            continue
        out += ["| regime | verdict | failing properties | worst relative error | "
                "first failure | reproduce |", "|---|---|---|---|---|---|"]
        notes = []
        for row in rows[spec]:
            mark = ""
            why = WHY.get((spec, row.label))
            if row.verdict == "FAIL" or (row.verdict == "N/A" and why):
                note = why or "Not yet traced to the library's code."
                if note not in notes:
                    notes.append(note)
                mark = f" [{notes.index(note) + 1}]"
            out.append(f"| {row.label} | **{row.verdict}**{mark} | {row.failed} | {row.worst} "
                       f"| {row.first} | `{row.command}` |")
        out.append("")
        out += [f"[{i}] {note}" for i, note in enumerate(notes, start=1)]
        out += [""] if notes else []
    return "\n".join(out).rstrip() + "\n"


_ROW = re.compile(r"^\| (?P<label>[^|]+?) \| \*\*(?P<verdict>PASS|FAIL|N/A|SKIP)\*\*[^|]* \| "
                  r"(?P<failed>[^|]+?) \|")


def verdicts(text: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(implementation, regime) -> (verdict, failing properties), read back from the doc."""
    found: dict[tuple[str, str], tuple[str, str]] = {}
    spec = ""
    for line in text.splitlines():
        if line.startswith("## `"):
            spec = line[4:].rstrip("`")
        elif line.startswith(f"<!-- {spec} | not run"):
            found[(spec, "every regime")] = ("not run", "")
        elif (m := _ROW.match(line)) and spec:
            found[(spec, m["label"])] = (m["verdict"], m["failed"])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help=f"compare with {DOC.name} instead of writing it")
    args = parser.parse_args(argv)
    rows = {spec: run_rows(spec) for spec in IMPLEMENTATIONS}
    text = render(rows, DOC.read_text(encoding="utf-8") if DOC.exists() else "")
    if not args.check:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC}", file=sys.stderr)
        return 0
    old, new = verdicts(DOC.read_text(encoding="utf-8")), verdicts(text)
    not_run = {spec for spec in IMPLEMENTATIONS if rows[spec][0].verdict == "not run"}
    stale = []
    for key in sorted(old.keys() | new.keys()):
        if key[0] in not_run:
            continue  # cannot run here (library missing, no CUDA): the doc's rows stand
        if old.get(key) != new.get(key):
            stale.append(f"{key[0]} / {key[1]}: doc says {old.get(key)}, code gives "
                         f"{new.get(key)}")
    for spec in sorted(not_run):
        print(f"not checked here: {spec} ({rows[spec][0].failed})", file=sys.stderr)
    if stale:
        print(f"{DOC.name} is stale; rerun python ci/implementations.py:\n  "
              + "\n  ".join(stale), file=sys.stderr)
        return 1
    print(f"{DOC.name} matches the code", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
