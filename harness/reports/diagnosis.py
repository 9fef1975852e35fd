"""The likely cause of a minimal failure, in one sentence, from the evidence the run has.

A reader of "grad of blocks.0.attn.qkv.weight: relative error 0.14 > bound
9.5e-07" still has to work out what is wrong. The run already holds what
tells the usual faults apart: which properties fail on the case, the first
recomputed op that differs from the forward (a random op, another dtype,
another shape, other values), the structure failures (a gradient that
exists on one path only), the recompute property's counts and bytes, and the
step a difference first shows at. :func:`diagnose` reads them in that order
and names the cause, with the evidence beside it.

Some failures are the model's: its forward changes state its re-run reads
again (a buffer, an attribute, an argument), draws from Python's or NumPy's
generators, or from a ``torch.Generator`` of its own; no checkpoint can
re-run such a forward faithfully. The localisation names what it saw
(``model ...`` lines); those causes come first, and with torch's own
checkpoint as the implementation the sentence says so outright: "your model
is not safe to recompute here".

Pure Python on report dicts: the supervisor and ``gradequiv report`` use it
without torch.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from gradequiv.harness.errors import exception_line
from gradequiv.harness.implementations.resolve import BUILTINS
from gradequiv.models.kinds import SCHEDULE_MICRO_BATCHES

__all__ = ["CAUSES", "MEMORY_FINDINGS", "Diagnosis", "diagnose", "distinct_faults",
           "divergence_cause", "fault_key", "state_name"]

#: Every cause a diagnosis can name.
CAUSES = ("raised", "input-captured", "output-structure", "refuses-autograd-grad",
          "refuses-pattern",
          "in-flight-state",
          "second-pass", "autocast-from-backward", "trainable-misread", "autocast-cast-cache",
          "process", "process-state",
          "global-state",
          "rng-not-restored",
          "autocast-lost", "kernel-changed", "dropout-skipped", "saved-output-changed",
          "inputs-lost",
          "hooks-skipped", "no-input-requires-grad",
          "input-grads-dropped", "grad-mode-ignored",
          "grad-touched", "model-own-generator", "model-python-random", "model-rerun-raised",
          "model-state-changed", "state-not-carried",
          "forward-changed", "buffers-updated-twice", "buffers-missed", "no-recompute",
          "recompute-count",
          "no-memory-saved", "leak", "recomputed-held", "rng-stream-moved", "later-step",
          "inference", "accumulation-lost", "second-order-lost", "param-grads-wrong",
          "nondeterministic", "other")


@dataclass
class Diagnosis:
    cause: str  # one of CAUSES: the headline's
    sentence: str  # the headline's cause, then each further fault's ("and a second fault: ")
    evidence: list[str] = field(default_factory=list)
    also: list[str] = field(default_factory=list)  # further faults the evidence shows (CAUSES)
    # each fault on its own, the headline's first: {"cause": ..., "sentence": ...}
    faults: list[dict[str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def diagnose(failure: dict[str, Any], record: dict[str, Any] | None) -> Diagnosis:
    """The likely cause of ``failure`` (a minimal failure of report.json), read from it and
    from its case's ``record`` (None when the run ended before the case was recorded)."""
    failing = _failing(record)
    evidence = [f"fails: {', '.join(failing) or failure['property']}"]
    evidence += [f"{name}: {line}" for name, line in _first_lines(record)[:3]]
    if failure.get("localisation"):
        evidence.append(failure["localisation"])
    cause, sentence = _cause(failure, record, failing)
    sentence = _named_generator(failure, cause) or sentence
    cause, sentence = _model_state(failure, record, cause) or (cause, sentence)
    sentence += _whose_counts(failure, cause)
    if failure.get("fresh_process_only"):  # whatever it did, it did so on a first case only
        cause, sentence = "process-state", (
            f"the implementation keeps state across cases at process level, set by its first "
            f"call (a module-level cache or flag): this case fails as the first case of a "
            f"fresh process, as a training process meets it on its first step, and passes "
            f"after other cases ran in one process; work such state out per call (or key it "
            f"by the module and what it depends on), not once per process. As the first "
            f"case: {sentence}")
    rerouted = (failure.get("first_diverging_op") or {}).get("rerouted")
    if rerouted:  # what the fault did to a routed model, before why
        sentence = f"{rerouted}, as {sentence}"
    also = _further_faults(cause, failure, record, failing)
    faults = [{"cause": c, "sentence": s} for c, s in [(cause, sentence), *also]]
    for _, other in also:
        sentence += f"; and a second fault: {other}"
    if failure.get("flaky") and cause != "nondeterministic":
        evidence.append("the failure did not come back when the case was run again")
    return Diagnosis(cause, sentence, evidence, [c for c, _ in also], faults)


#: What the recompute property's byte findings say (nothing freed, a leak, re-runs held to
#: the end of backward): a difference in memory only, which no op's value shows.
MEMORY_FINDINGS = ("nothing was freed", "a leak", "recomputed earlier for")
#: Causes read from the recompute property's counts and bytes: evidence no value fault makes.
_MEMORY_CAUSES = ("no-memory-saved", "no-recompute", "leak", "recomputed-held",
                  "recompute-count")
#: Causes that already account for buffers that differ.
_BUFFER_CAUSES = ("buffers-updated-twice", "buffers-missed", "model-state-changed")
#: Causes that already account for the caller's stream.
_STREAM_CAUSES = ("rng-not-restored", "rng-stream-moved", "global-state", "model-own-generator",
                  "model-python-random", "nondeterministic")


def _further_faults(cause: str, failure: dict[str, Any], record: dict[str, Any] | None,
                    failing: list[str]) -> list[tuple[str, str]]:
    """Faults besides the headline's that evidence of their own shows: each property a
    headline cause cannot explain, with its own cause. Lost autocast changes no RNG stream,
    no buffer and no byte count; a stream left moved (the rng property's story), buffers
    that differ while the re-run's values match, a memory finding, a gradient missing on
    one path are each a fault of their own."""
    if record is None or record.get("error") or cause in ("process", "raised", "other",
                                                          "input-captured"):
        return []  # a captured argument's lost gradients and re-runs are its own doing
    texts = {name: _texts(record, name) for name in failing}
    found: list[tuple[str, str]] = []
    story = _story(texts)
    if story and cause not in _STREAM_CAUSES:
        if " left advanced" in story:  # the re-run drew from the caller's stream
            found.append(("rng-not-restored", (
                f"the recompute does not restore the RNG state: its re-run drew from the "
                f"caller's stream ({story[story.index('the caller'):]}), so its random ops "
                f"drew other numbers than the forward's")))
        else:
            found.append(("rng-stream-moved", _stream_moved(story, texts, step1=False)))
    if "buffers" in failing and cause not in _BUFFER_CAUSES \
            and not _statistics_follow_forward(failure, record, cause):
        found.append(_buffers(record, texts))
    if "recompute" in failing and cause not in _MEMORY_CAUSES:
        other, sentence = _cause({**failure, "property": "recompute",
                                  "first_diverging_op": None}, record, ["recompute"])
        if other in _MEMORY_CAUSES:
            found.append((other, sentence))
    missing = _missing(texts)
    if missing and cause not in ("input-grads-dropped", "no-input-requires-grad",
                                 "no-recompute", "no-memory-saved", "trainable-misread") \
            and not any(c == "no-recompute" for c, _ in found):
        found.append(("input-grads-dropped", _grads_dropped(missing[0])))
    return found


def _story(texts: dict[str, list[str]]) -> str:
    """The rng property's story of the caller's stream (verify._rng_stories), or ""."""
    return next((t for t in texts.get("rng", []) if "caller's cpu generator was left" in t), "")


def _missing(texts: dict[str, list[str]]) -> list[str]:
    """The gradients full storage has and the recompute path does not."""
    return [t for t in texts.get("gradients", []) if "absent on the recompute path" in t
            or "exists only on the full-storage" in t]


def _grads_dropped(missing: str) -> str:
    return (f"the recompute path has no gradient where full storage has one "
            f"({missing.split(':')[0]}): the checkpoint does not pass gradients back to every "
            f"input that requires grad (a keyword argument, a part of a tuple, a detached "
            f"input)")


def _statistics_follow_forward(failure: dict[str, Any], record: dict[str, Any] | None,
                               cause: str) -> bool:
    """Whether buffers that differ are the headline's doing: every counter agrees with full
    storage's (so no update ran twice or was missed), and the headline cause is a forward
    that differs (a re-run op parted, or the stream moved), whose statistics differ with it.
    A counter ahead or behind is a fault of its own."""
    counters = [c for p in (record or {}).get("properties", []) if p["name"] == "buffers"
                for c in p.get("checks", []) if c.get("counts")]
    if any(c["counts"][0] != c["counts"][1] for c in counters):
        return False
    return bool(failure.get("first_diverging_op")) or cause in _STREAM_CAUSES


def _buffers(record: dict[str, Any] | None, texts: dict[str, list[str]]) -> tuple[str, str]:
    """The buffers that differ, told by which way a counter is off: more updates than full
    storage's (the re-run updates them a second time) or fewer (only the re-run updates
    them, so a forward without backward never does)."""
    counted = next((c for p in (record or {}).get("properties", []) if p["name"] == "buffers"
                    for c in p.get("checks", []) if not c.get("passed") and c.get("counts")),
                   None)
    if counted is not None and counted["counts"][0] < counted["counts"][1]:
        ours, theirs = counted["counts"]
        return "buffers-missed", (
            f"module state differs from full storage's ({counted['name']} is {ours} on the "
            f"recompute path, {theirs} with full storage): buffers (running statistics, "
            f"counters) are updated fewer times than without recompute; the forward leaves "
            f"them alone and only the re-run updates them, so a forward without backward "
            f"(under no_grad in train mode) never does: update them in the forward and "
            f"skip the update in the re-run")
    said = (f"{counted['name']} is {counted['counts'][0]} on the recompute path, "
            f"{counted['counts'][1]} with full storage" if counted is not None
            else _tensor(texts["buffers"]))
    return "buffers-updated-twice", (
        f"module state differs from full storage's ({said}): the re-run updates buffers "
        f"(running statistics, counters) a second time")


#: How the router's error begins where a recompute handed back another structure than the
#: segment returns (a None field dropped, a named tuple made a plain one): the sentence.
_ERROR_NAME = "WrongReturn: "
_STRUCTURE_CHANGED = f"{_ERROR_NAME}the output structure of "


def _cause(failure: dict[str, Any], record: dict[str, Any] | None,
           failing: list[str]) -> tuple[str, str]:
    prop = failure["property"]
    if prop == "process":
        return "process", f"the implementation ended or stalled the process: {failure['message']}"
    if record is not None and record.get("error"):
        last = exception_line(record["error"])
        if _refuses_autograd_grad(last):
            return "refuses-autograd-grad", (
                f"the implementation refuses torch.autograd.grad ({last}); if that is by "
                f"design, as with torch's reentrant checkpoint, declare "
                f"`gradequiv_unsupported = (\"autograd-grad\",)` on the callable and those "
                f"cases are skipped")
        if failure.get("captured"):
            return "input-captured", _captured(failure, record, raised=last)
        if _STRUCTURE_CHANGED in last:
            return "output-structure", last[last.index(_STRUCTURE_CHANGED) + len(_ERROR_NAME):]
        refused = _refused_pattern(last, record)
        if refused:
            return "refuses-pattern", (
                f"the implementation refuses {_PATTERN_WORDS[refused]} ({last}); if that is "
                f"by design, declare `gradequiv_unsupported = (\"{refused}\",)` on the "
                f"callable and those cases are skipped")
        if "backward" in (record.get("error_at") or ""):
            found = _model_draws(failure, raised=last)
            if found is not None:
                return found
            # the re-run parted from its forward before it raised; unless the forward
            # changed an input the re-run read (the model's: model-rerun-raised, below)
            op = failure.get("first_diverging_op")
            found = _from_divergence(op) if op and not _model_lines(
                failure, "model input: ") else None
            if found is not None:
                return found[0], f"{found[1]}; the re-run then raised: {last}"
        frames = record.get("user_frames") or []
        at = f" (in your code at {frames[-1]})" if frames else ""
        return "raised", (f"the implementation raised during {record.get('error_at') or 'the run'}"
                          f": {last}{at}")
    texts = {name: _texts(record, name) for name in failing}
    leaked = [t for t in texts.get("rng", []) if "changed torch's global state" in t]
    if leaked:
        return "global-state", leaked[0].replace("the implementation", "the recompute path", 1)
    found = _model_draws(failure)
    if found is not None:
        return found
    op = failure.get("first_diverging_op")
    if op:
        found = _from_divergence(op)
        if found is not None:
            return found
    if failure.get("needs_pattern"):
        return _needs_pattern(failure["needs_pattern"], (record or {}).get("case") or {})
    if failure.get("needs_autocast_cache") and not op:
        return "autocast-cast-cache", _autocast_cache(failure, (record or {}).get("case") or {},
                                                      texts)
    if failure.get("captured"):
        return "input-captured", _captured(failure, record)
    extra = next((t for t in texts.get("gradients", []) if "exists only on the recompute" in t
                  or "absent on the full-storage path" in t), "")
    if extra or any("its forward ran under no_grad" in t for t in texts.get("recompute", [])):
        where = f" ({extra.split(':')[0]})" if extra else ""
        return "grad-mode-ignored", (
            f"the recompute path has gradients where full storage has none{where}: the "
            f"checkpoint builds a graph for a forward that ran under no_grad (a frozen layer), "
            f"so the frozen weights and what feeds them get gradients")
    missing = _missing(texts)
    kind = (record or {}).get("case") or {}
    if missing and "outputs" in failing and kind.get("grad_mode") != "accumulate":
        # the forward already differs: a gradient it no longer has follows from that
        return "forward-changed", _forward_changed(texts)
    if missing and _no_input_requires_grad(record, missing):
        return "no-input-requires-grad", (
            f"no input of the segment requires grad, so this reentrant checkpoint gives its "
            f"parameters no gradient ({missing[0].split(':')[0]} is None): its backward only "
            f"runs when an input needs a gradient (frozen embeddings before the first "
            f"checkpointed layer); give the segment an input that requires grad, or use the "
            f"non-reentrant variant")
    if missing:
        return "input-grads-dropped", _grads_dropped(missing[0])
    for text in texts.get("gradients", []):
        if "changed .grad" in text:
            return "grad-touched", (
                "torch.autograd.grad wrote into .grad: the recompute runs backward inside "
                "backward instead of returning its gradients; return them from the "
                "Function's backward (torch.autograd.grad inside it, not .backward()), or, "
                "if your training never calls torch.autograd.grad, declare "
                "`gradequiv_unsupported = (\"autograd-grad\",)` on the callable and those "
                "cases are skipped")
    inputs = [t for t in texts.get("gradients", []) if t.startswith("grad of input ")]
    if inputs and failure.get("first_diverging_op") is None:
        return "input-grads-dropped", (
            f"{_ops_said(failure)}, but the gradient reaching "
            f"{inputs[0].removeprefix('grad of ')} does not: the checkpoint passes wrong or no "
            f"gradients back to some of its inputs (a keyword argument, a part of a tuple "
            f"output, a detached input)")
    found = None if failure.get("flaky") else _gradients_only(kind, failing, texts, op,
                                                              _ops_said(failure))
    if found is not None:
        return found
    recompute = texts.get("recompute", [])
    said = {key: next((t for t in recompute if key in t), "") for key in (
        "nothing was recomputed", "time(s) in", *MEMORY_FINDINGS)}
    if said["nothing was recomputed"] and said["nothing was freed"]:
        return "no-memory-saved", ("no memory was saved: the segments did not run again in "
                                   "backward and the recompute path held as many activation "
                                   "bytes as full storage (the checkpoint keeps every "
                                   "activation, as without one)")
    if said["nothing was recomputed"]:
        return "no-recompute", (f"nothing was recomputed: "
                                f"{said['nothing was recomputed'].split(':')[0]}'s segment did "
                                f"not run again in backward (its activations were kept, or it "
                                f"ran where nothing can see it)")
    if said["nothing was freed"]:
        return "no-memory-saved", ("no memory was saved: the recompute path held as many "
                                   "activation bytes between forward and backward as full "
                                   "storage (the segments' activations are still kept)")
    if said["a leak"]:
        return "leak", ("the recompute keeps memory alive past backward: bytes made in the "
                        "step outlive it (growing with every step, or held until the next "
                        "forward where the model stores what its re-run makes)")
    if said["recomputed earlier for"]:
        return "recomputed-held", (
            f"the recompute keeps recomputed activations alive until the whole backward ends "
            f"({said['recomputed earlier for'].split(': the recompute')[0]}): nothing is left "
            f"after backward, but backward's peak grows back towards full storage's (a "
            f"reference cycle between a Function's context and its graph, a list of re-run "
            f"outputs cleared at the end)")
    if said["time(s) in"]:
        return "recompute-count", f"segments re-run the wrong number of times: {said['time(s) in']}"
    step1 = {"outputs", "gradients"} & set(failing)
    if "buffers" in failing and not step1:
        found = _buffers(record, texts)
        return found[0], f"outputs and gradients match, but {found[1]}"
    story = _story(texts)
    accumulated = kind.get("grad_mode") == "accumulate"
    if "rng" in failing and not step1:
        return "rng-stream-moved", (f"outputs and gradients match, but "
                                    f"{_stream_moved(story, texts, step1=False)}")
    if "rng" in failing and story and accumulated and "outputs" in failing and not op:
        return "rng-stream-moved", _stream_moved(story, texts, step1=True)
    if "trajectory" in failing and not step1 and "buffers" not in failing:
        return "later-step", (
            f"step 1 matches full storage, but a later step does not "
            f"({_tensor(texts['trajectory'])}): the fault only shows once state carried "
            f"between steps is used (a cache, a counter, a kept graph, a hook that fires "
            f"once)")
    if "inference" in failing and not step1:
        return "inference", (f"a forward without backward (eval or no_grad) through the "
                             f"implementation differs from full storage's "
                             f"({_tensor(texts['inference'])}): the implementation changes "
                             f"forwards it should leave alone, or keeps state from them")
    if failure.get("flaky"):
        return "nondeterministic", ("the failure did not come back when the case ran again: "
                                    "the implementation is nondeterministic")
    if "outputs" in failing:
        return "forward-changed", _forward_changed(texts)
    first = failure["message"].splitlines()[0] if failure.get("message") else prop
    return "other", f"property {prop} fails: {first}"


#: What to do about each cause on the model's side.
_FIXES = {
    "model-own-generator": (
        "draw from torch's default generator (whose state the checkpoint saves and restores), "
        "or draw outside the checkpointed module and pass the mask in as an argument"),
    "model-python-random": (
        "draw outside the checkpointed module and pass the result in as an argument (the "
        "checkpoint keeps its arguments), or draw from torch's default generator, whose state "
        "the checkpoint restores"),
    "model-state-changed": (
        "make the update outside the checkpointed module and pass in what the forward reads "
        "as an argument (the checkpoint keeps its arguments), or leave the module out of the "
        "checkpoint; skipping the update in the re-run (`torch._C._current_graph_task_id() "
        "!= -1` inside backward, as the reference model's counters do) is enough only where "
        "the forward does not read what it updates"),
    "model-rerun-raised": (
        "leave what the forward is given and keeps as it found it (read without popping, "
        "copy before changing it in place), or make the change outside the checkpointed "
        "module"),
}


#: The localisation's line for a named generator state a re-run started from other than its
#: forward did (``engine/model_watch.py``, ``_named_finding``).
_NAMED_STATE = re.compile(
    r"the re-run of (?P<segment>\S+) started from (?P<state>.+) (?P<how>advanced \d+ draws "
    r"past the forward's|other than the forward's) \(the forward moved it, and nothing set it "
    r"back\), (?P<default>while|and) torch's default generator")


def _named_generator(failure: dict[str, Any], cause: str) -> str | None:
    """The rng-not-restored sentence told by the generator state the re-run drew from, where
    the localisation saw a named one (an RNG tracker's, as Megatron keeps for dropout in
    tensor-parallel regions) start the re-run other than it started the forward: saving and
    restoring the default generator alone, as torch's checkpoint does, is not enough."""
    if cause != "rng-not-restored":
        return None
    op = failure.get("first_diverging_op") or {}
    found = [m for m in map(_NAMED_STATE.match, _model_lines(failure, "named rng state: ")) if m]
    if not found:
        return None
    match = next((m for m in found if m["segment"] == op.get("segment")), found[0])
    state, how = match["state"], match["how"]
    drew = ""
    if op.get("random"):
        drew = (f", so {op['op']} in {op.get('module') or op['segment']} draws other random "
                f"numbers than in the forward ({op['differing']:.0%} of the draws differ)")
    if match["default"] == "while":
        return (f"the recompute does not restore the RNG state of {state}, a named generator "
                f"state: it puts torch's default generator back for the re-run of "
                f"{match['segment']}, but that re-run drew under the named state {how}{drew}; "
                f"save and restore every named state with the default generator's, as "
                f"Megatron's checkpoint does with its RNG tracker's states")
    return (f"the recompute does not restore the RNG state: neither torch's default generator "
            f"nor {state}, a named generator state, is put back for the re-run of "
            f"{match['segment']}, which drew under the named state {how}{drew}; save and "
            f"restore both, as Megatron's checkpoint does with its RNG tracker's states")


def _model_lines(failure: dict[str, Any], prefix: str) -> list[str]:
    """The localisation's lines on the model's side that begin with ``prefix``, without it."""
    return [part.removeprefix(prefix) for part in (failure.get("localisation") or "").split("; ")
            if part.startswith(prefix)]


def _model_draws(failure: dict[str, Any], raised: str = "") -> tuple[str, str] | None:
    """The model's draws from a generator no checkpoint restores, where the localisation saw
    one: whatever else differs follows from them."""
    for cause, prefix in (("model-own-generator", "model generator: "),
                          ("model-python-random", "model random: ")):
        lines = _model_lines(failure, prefix)
        if lines:
            return cause, _model_sentence(failure, cause, lines[0], raised)
    return None


#: Causes a change the model made to what its re-run reads may explain better: a re-run
#: computing another thing, a raise; and under torch's own checkpoint, which re-runs
#: faithfully, a fault seen only at a later step, in buffers, in a stored output read back
#: (it keeps no store: the model's state is what was read), in a later forward (the next
#: micro-batch's, an eval one's), in gradients alone or nowhere in particular.
_REFINED = ("raised", "inputs-lost", "dropout-skipped")
_REFINED_UNDER_TORCH = ("later-step", "buffers-updated-twice", "buffers-missed",
                        "saved-output-changed", "forward-changed", "inference",
                        "param-grads-wrong", "accumulation-lost", "second-order-lost",
                        "other")


def _model_state(failure: dict[str, Any], record: dict[str, Any] | None,
                 cause: str) -> tuple[str, str] | None:
    """``cause`` told more exactly where the localisation saw the model change state its
    re-run reads: a buffer, an attribute, an argument. Under another implementation than
    torch's own, a cache that grew or a tensor kept is no explanation by itself (a faithful
    recompute finds the same values in it), so the implementation's cause stands there."""
    torch_own = _torch_own(failure)
    beside = bool(failure.get("torch_checkpoint")) and cause not in _COUNTED
    if cause not in _REFINED and not ((torch_own or beside) and cause in _REFINED_UNDER_TORCH):
        return None
    lines = [line for line in _model_lines(failure, "model input: ")
             + _model_lines(failure, "model state: ") if torch_own or _telling(line)]
    op = failure.get("first_diverging_op")
    if cause in ("inputs-lost", "dropout-skipped") and op:  # the segment computing another thing
        lines = [line for line in lines if f"{op['segment']}'s forward" in line]
    if not lines:
        return None
    if cause == "raised":
        if "backward" not in ((record or {}).get("error_at") or ""):
            return None
        raised = exception_line((record or {}).get("error", ""))
        return _checkpoint_s(failure, lines[0], raised) or (
            "model-rerun-raised", _model_sentence(failure, "model-rerun-raised", lines[0],
                                                  raised))
    return _checkpoint_s(failure, lines[0]) or (
        "model-state-changed", _model_sentence(failure, "model-state-changed", lines[0]))


#: What a checkpoint must do about state its re-run met otherwise than its forward, by what
#: happened to it (words of the localisation's line).
_CARRY = (
    ("was set around the forward and not around its re-run",
     "enter it around the re-run as the forward found it, in the checkpoint's recompute "
     "context (TransformerEngine's and Megatron's checkpoints re-enter fp8_autocast so)"),
    ("was recorded into by",
     "mark the re-run as one, so that the model records nothing in it (TransformerEngine's "
     "checkpoint sets its recompute phase so)"),
    ("was changed after",
     "keep copies of the state the forward ran with, taken when it ran (a reference sees "
     "every later change), and give them to the re-run"),
)
#: The same, where the model must: torch's own checkpoint gets it wrong too.
_KEEP = (
    ("was set around the forward and not around its re-run",
     "set it inside the checkpointed module, or checkpoint with one that re-enters it "
     "around the re-run (torch's checkpoint restores only the RNG and autocast states)"),
    ("was recorded into by",
     "record in a forward only, never in a re-run: `torch._C._current_graph_task_id() == -1` "
     "holds in a forward and not in a re-run inside backward, whichever checkpoint runs it "
     "(a guard on grad mode counts in every re-run of a reentrant checkpoint, one per "
     "backward pass, and in both runs under a non-reentrant one), or make the update "
     "outside the checkpointed module"),
)


def _checkpoint_s(failure: dict[str, Any], what: str,
                  raised: str = "") -> tuple[str, str] | None:
    """The sentence for state the re-run met otherwise than its forward where torch's own
    checkpoint, run beside, shows the fault is the checkpoint's: it passes the case, or
    fails it on other state."""
    beside = failure.get("torch_checkpoint") or {}
    if _torch_own(failure) or beside.get("verdict") not in ("passes", "other"):
        return None
    because = f"its re-run raised ({raised}), because " if raised else ""
    evidence = ("torch's own checkpoint passes this case (run beside it), so the fault is "
                "the checkpoint's" if beside["verdict"] == "passes" else
                f"torch's own checkpoint fails this case too, but on other state "
                f"({state_name(beside.get('state', '')) or 'state the search did not name'}), "
                f"so this state is the checkpoint's doing")
    fix = next((fix for words, fix in _CARRY if words in what), _CARRY[-1][1])
    return "state-not-carried", (f"the checkpoint does not give the re-run the state its "
                                 f"forward ran with: {because}{what}; {evidence}; {fix}")


#: Causes that already name the buffers and which way their counts went: told whose they
#: are (``_whose_counts``), not told again.
_COUNTED = ("buffers-updated-twice", "buffers-missed")


def _whose_counts(failure: dict[str, Any], cause: str) -> str:
    """What torch's own checkpoint, run beside, says of a buffer cause: whose it is."""
    verdict = (failure.get("torch_checkpoint") or {}).get("verdict")
    if cause not in _COUNTED or verdict is None:
        return ""
    if verdict == "passes":
        return "; torch's own checkpoint passes this case (run beside it), so the fault is " \
               "the checkpoint's"
    return "; torch's own checkpoint fails this case too (run beside it): the model's " \
           "buffers need a checkpoint that puts them back after its re-run"


def _telling(line: str) -> bool:
    """Whether a change the localisation saw can make a re-run differ by itself: not a
    container that grew (a cache filled) nor a tensor attribute (a value kept), nor what a
    forward changed where no re-run was seen (a running statistic the re-run may skip)."""
    if "(a tensor attribute)" in line or "the re-run itself was not seen" in line:
        return False
    lengths = re.search(r"length (\d+) at the forward, (\d+) at the re-run", line)
    return lengths is None or int(lengths[2]) < int(lengths[1])


def state_name(line: str) -> str:
    """The qualified name a localisation's line on the model's side begins with."""
    return line.partition(": ")[2].partition(" (")[0]


def _model_sentence(failure: dict[str, Any], cause: str, what: str, raised: str = "") -> str:
    because = f"its re-run raised ({raised}), because " if raised else ""
    same = (failure.get("torch_checkpoint") or {}).get("verdict") == "same"
    headline = ("your model is not safe to recompute here" if _torch_own(failure) else
                "the model is not safe to recompute here: torch's own checkpoint fails this "
                "case the same way (run beside it), so the state is the model's to keep"
                if same else
                "the model is not safe to recompute here, whichever checkpoint runs it")
    fix = next((fix for words, fix in _KEEP if words in what), _FIXES[cause])
    return f"{headline}: {because}{what}; {fix}"


def _torch_own(failure: dict[str, Any]) -> bool:
    """Whether the failure's reproduce line runs torch's own checkpoint (a built-in, or a
    target in torch itself) as it comes: an implementation known to re-run faithfully.
    Options given to it (``--impl-kwarg preserve_rng_state=false``) may make it wrong."""
    try:
        words = shlex.split(failure.get("reproduce") or "")
    except ValueError:
        return False
    spec = next((b for a, b in zip(words, words[1:]) if a == "--impl"), "")
    return (spec in BUILTINS or spec.startswith("torch.")) and "--impl-kwarg" not in words


def _forward_changed(texts: dict[str, list[str]]) -> str:
    return (f"the forward itself differs from full storage's ({_tensor(texts['outputs'])}), "
            f"before any recompute: the implementation changes what the segment computes")


def _ops_said(failure: dict[str, Any]) -> str:
    """What the localisation says of the re-run's ops, as evidence a sentence may state:
    that they match only where it compared them (never a claim it contradicts)."""
    if "every recomputed op" in (failure.get("localisation") or ""):
        return "the recomputed ops match the forward's"
    return "no recomputed op was seen to differ from its forward"


def _autocast_cache(failure: dict[str, Any], case: dict[str, Any],
                    texts: dict[str, list[str]]) -> str:
    """The autocast-cast-cache sentence: the property holds with the cache off on both paths
    (``needs_autocast_cache``)."""
    low = "float16" if str(case.get("dtype", "")).startswith("fp16") else "bfloat16"
    worst = _tensor(texts.get("gradients") or texts.get("trajectory") or [])
    return (f"{_ops_said(failure)}, and with autocast's cast cache off on both paths the "
            f"gradients agree, but with it on they differ ({worst}): the re-run's segment "
            f"inputs are leaves that require grad (a reentrant checkpoint detaches them), which "
            f"the cache casts to {low} once for all their uses, so their gradients are summed "
            f"in {low} where full storage sums them in float32: a real difference of reentrant "
            f"checkpointing under autocast; the non-reentrant checkpoint, or "
            f"torch.autocast(..., cache_enabled=False), has none")


def _gradients_only(kind: dict[str, Any], failing: list[str], texts: dict[str, list[str]],
                    op: dict[str, Any] | None, ops: str) -> tuple[str, str] | None:
    """Gradients wrong while the forward and every recomputed op match: told by how the
    case asks for gradients (accumulated, a gradient penalty), by forwards without backward
    before it, or by which gradients differ (parameters only)."""
    if "gradients" not in failing or "outputs" in failing or op:
        return None
    worst = _tensor(texts["gradients"])
    if kind.get("grad_mode") == "accumulate":
        return "accumulation-lost", (
            f"{ops}, but with gradients accumulated over "
            f"micro-batches they differ ({worst}): the checkpoint overwrites or drops what "
            f"earlier micro-batches left in .grad (reads parameter gradients back from a "
            f".grad it cleared), where torch accumulates")
    if kind.get("grad_mode") == "create-graph":
        return "second-order-lost", (
            f"{ops}, but under a gradient penalty the "
            f"gradients differ ({worst}): the checkpoint's backward takes the segment's "
            f"gradients without create_graph (on detached inputs), so the penalty's "
            f"second-order terms through the segment are lost")
    if kind.get("inference"):
        return "inference", (
            f"{ops}, but this case runs eval and no_grad forwards before training and its "
            f"gradients differ ({worst}): "
            f"the implementation keeps state from forwards that had no backward (a queue of "
            f"RNG states every forward pushes and only backward pops)")
    grads = [t for t in texts["gradients"] if t.startswith("grad of ")]
    if grads and not any(t.startswith("grad of input ") for t in grads):
        return "param-grads-wrong", (
            f"{ops} and every gradient reaching a segment's "
            f"inputs does too, but parameter gradients differ ({worst}): the checkpoint "
            f"returns wrong gradients for parameters it reads (one counted twice, returned "
            f"and also accumulated into .grad, or one it does not own left out)")
    return None


#: What a recompute does to the caller's stream for each story, and the fix.
_STREAM_FIX = {
    "rewound": "restores the forward's RNG state for the re-run and never gives the caller's "
               "back (restore it inside torch.random.fork_rng)",
    "advanced": "draws from the caller's stream in the re-run (restore the forward's state "
                "inside torch.random.fork_rng)",
    "reseeded": "seeds the global generator (manual_seed) where it should restore the "
                "forward's state inside torch.random.fork_rng",
}


def _captured(failure: dict[str, Any], record: dict[str, Any] | None, *, raised: str = "") -> str:
    """The input-captured sentence: which argument the checkpoint reached by closure (or in
    a container) instead of passing it to its autograd.Function, what that did, the fix,
    and the user's line that calls the segment (``captured``: the experiment of
    ``engine/captured.py``)."""
    found = failure["captured"]
    names = found["arguments"]
    what = (f"the segment's argument{'s' if len(names) > 1 else ''} "
            f"{', '.join(f'`{n}`' for n in names)}")
    if raised:
        did = (f"its re-run's inner backward goes on from {'them' if len(names) > 1 else 'it'} "
               f"into the caller's graph and frees it, so the next backward through that graph "
               f"raises ({raised})")
    else:
        missing = _missing({"gradients": _texts(record, "gradients")})
        lost = f" ({missing[0].split(':')[0]})" if missing else ""
        did = (f"no gradient reaches {'them' if len(names) > 1 else 'it'} through the "
               f"checkpoint{lost}, and where none of the Function's inputs requires grad "
               f"nothing is recomputed")
    at = f"; the segment is called at {found['frame']}" if found.get("frame") else ""
    return (f"the checkpoint captures {what} (a tensor reached through a closure or a "
            f"container) instead of passing it to its autograd.Function as an input: {did}; "
            f"passed as an input, the fault goes away (tried: {', '.join(names)} passed "
            f"positionally); pass every tensor argument, keyword and nested ones too, as an "
            f"input of the Function and re-run on detached copies{at}")


def _stream_moved(story: str, texts: dict[str, list[str]], *, step1: bool) -> str:
    """The rng-stream-moved sentence: what the recompute left the caller's stream at (the
    story verify tells: rewound, advanced or reseeded) and where that first shows (after
    the step; ``step1``: in the next micro-batch's forward)."""
    if not story:
        return (f"the RNG stream after the step differs "
                f"from full storage's ({_generator(texts['rng'])}): the recompute draws "
                f"random numbers and leaves the generator moved, so every later random op "
                f"draws other numbers")
    kind = story.split(" was left ", 1)[1].split(" ", 1)[0].rstrip(",")
    does = _STREAM_FIX.get(kind, "leaves the caller's stream moved")
    if step1:  # accumulation: the next micro-batch's forward draws from the moved stream
        return (f"{story}: the recompute {does}; with gradient accumulation micro-batch 2's "
                f"random ops then draw other numbers than with full storage, so its forward "
                f"differs ({_tensor(texts.get('outputs', []))}): the segment computes the same, "
                f"the stream it draws from does not")
    return f"{story}: the recompute {does}, so every later random op draws other numbers"


def _no_input_requires_grad(record: dict[str, Any] | None, missing: list[str]) -> bool:
    """Whether a segment ran on inputs none of which requires grad: torch's reentrant
    checkpoint warns so; frozen embeddings feed the first layer such inputs, and then the
    gradients missing are the layers' own (each layer's input comes from the one before)."""
    if record is None:
        return False
    if any("None of the inputs have requires_grad=True" in w
           for w in record.get("warnings", [])):
        return True
    model = (record.get("case") or {}).get("model") or {}
    return bool(model.get("freeze_embeddings")) and all(
        t.startswith(("grad of blocks.", "grad of input blocks.")) for t in missing)


#: What a case's training-loop pattern is, in words, by its declaration name.
_PATTERN_WORDS = {"retain-graph": "a second backward pass over one forward (retain_graph)",
                  "gpipe": "several micro-batches in flight", "gpipe-reverse":
                  "several micro-batches in flight", "1f1b": "several micro-batches in flight",
                  "summed": "one backward over several forwards"}


def _needs_pattern(patterns: list[str], case: dict[str, Any]) -> tuple[str, str]:
    """The cause of a failure the case's training-loop patterns alone show (the property
    holds with them off: ``needs_pattern``)."""
    first = patterns[0]
    if first in SCHEDULE_MICRO_BATCHES:
        n = SCHEDULE_MICRO_BATCHES[first]
        return "in-flight-state", (
            f"the case passes with each micro-batch's backward right after its forward and "
            f"fails with {n} micro-batches in flight ({first}): what the implementation keeps "
            f"between a forward and its backward (saved boundaries, RNG or autocast state, "
            f"host buffers) is not each call's own, so one forward's is overwritten or taken by "
            f"another's; key it by the call (a token only its autograd context holds)")
    if first == "retain-graph":
        return "second-pass", (
            f"the case passes with one backward pass and fails with the loss backpropagated "
            f"in {case.get('backward_passes', 2)} parts (retain_graph=True): a later backward "
            f"pass over the same forward re-runs or accumulates differently (RNG state or "
            f"saved inputs used up by the first pass, a leaf's .grad kept from it)")
    if first == "backward-autocast":
        return "autocast-from-backward", (
            "the case passes with backward outside autocast and fails with backward inside "
            "an autocast block: the re-run ran in backward's autocast state, not the "
            "forward's (autocast off, in a forward or in one of its layers, is a state to "
            "restore too)")
    return "trainable-misread", (
        f"the case passes with every parameter training and fails with "
        f"trainable={first!r}: the implementation decides from which parameters train "
        f"once, or skips a segment with nothing to train, so gradients stop at a frozen "
        f"segment or miss parameters unfrozen later (requires_grad is a fact of each call, "
        f"and a frozen segment still passes gradients to its inputs)")


def _refused_pattern(line: str, record: dict[str, Any]) -> str:
    """The case's training-loop pattern an exception refuses by name ("backward an extra
    time", "backward through the graph a second time", "only once"), or ""."""
    case = record.get("case") or {}
    text = line.lower()
    if (case.get("backward_passes") or 1) > 1 and any(word in text for word in (
            "extra time", "second time", "only allowed to backward once", "retain_graph",
            "more than once")):
        return "retain-graph"
    schedule = case.get("schedule") or "one"
    if schedule != "one" and any(word in text for word in (
            "in flight", "micro-batch", "microbatch", "pipeline", "not supported",
            "unsupported")):
        return str(schedule)
    return ""


def _refuses_autograd_grad(line: str) -> bool:
    """Whether an exception's last line is a refusal of torch.autograd.grad (torch's reentrant
    checkpoint: "... is incompatible with .grad() or passing an `inputs` parameter to
    .backward()"), not a crash."""
    text = line.lower()
    return any(name in text for name in (".grad()", "autograd.grad")) and any(
        word in text for word in ("incompatible", "not compatible", "not supported",
                                  "does not support", "unsupported"))


def divergence_cause(op: dict[str, Any] | None) -> str | None:
    """The cause a first diverging op names by itself (None: it names none, and the
    experiments that tell other causes apart are needed)."""
    found = _from_divergence(op) if op else None
    return found[0] if found else None


def _from_divergence(op: dict[str, Any]) -> tuple[str, str] | None:
    """A cause from the first recomputed op that differs from its original."""
    where = f"{op['op']} in {op.get('module') or op['segment']}"
    if op.get("past_hooks") and not op.get("random"):
        return "hooks-skipped", (
            f"the recompute calls {op['segment']}'s forward directly (module.forward, not "
            f"module(...)): the forward and pre-hooks registered on it (a LoRA, a steering "
            f"vector, an input rescale) ran in the forward and not in the re-run, which "
            f"parts from it at {where}; call the module itself in the recompute")
    forward, again = op.get("forward", ""), op.get("recompute", "")
    if op.get("random") and forward == again:
        return "rng-not-restored", (
            f"the recompute does not restore the RNG state: {where} draws other random "
            f"numbers in the re-run than in the forward ({op['differing']:.0%} of the draws "
            f"differ)")
    dtype_a, shape_a = _signature(forward)
    dtype_b, shape_b = _signature(again)
    if dtype_a and dtype_b and dtype_a != dtype_b:
        return "autocast-lost", (
            f"the recompute runs {where} in {dtype_b} where the forward ran it in {dtype_a}: "
            f"the autocast state (on or off, and its dtype) is not carried into the re-run")
    drawn, redrawn = op.get("draws") or (0, 0)
    if op.get("stale"):
        how = "" if "wrote into it" in op["stale"] else (
            "; an in-place op wrote into it after it was saved (a scale, a mask, an in-place "
            "dropout)")
        # torch's selective checkpoint raises only where the write moved the saved tensor's
        # version counter (pytorch/pytorch#113737, #119590)
        torch_sac = ("torch's selective checkpoint does not see such a write: it checks the "
                     "saved tensor's version counter, which this one did not move; "
                     "pytorch/pytorch#113737, #119590" if op.get("stale_unversioned")
                     else "torch's selective checkpoint raises on this")
        return "saved-output-changed", (
            f"the recompute takes outputs of the forward's ops from a store instead of "
            f"computing them, and one had changed since it was saved: {op['stale']}{how}; "
            f"the re-run reads the changed values: save a copy, or leave outputs that are "
            f"later changed in place out of what is saved ({torch_sac})")
    if redrawn < drawn and (shape_a != shape_b or forward != again):
        return "dropout-skipped", (
            f"the re-run of {op['segment']} runs {redrawn or 'no'} random op"
            f"{'' if redrawn == 1 else 's'} where its forward ran {drawn} (dropout), and "
            f"takes another path from {where} on: the recompute runs the segment with dropout "
            f"off (in eval mode, or with its dropout disabled); carry the segment's training "
            f"mode into the re-run")
    kernels = [name for name in (forward, again) if "scaled_dot_product" in name]
    if kernels and forward != again:
        return "kernel-changed", (
            f"the re-run of {op['segment']} computes attention in "
            f"{op.get('module') or op['segment']} with another kernel than its forward "
            f"(forward: {forward}, re-run: {again}; the two round differently): the "
            f"attention backend chosen around the forward (sdpa_kernel, a backend flag) is not "
            f"in force around the re-run; re-enter the forward's choice in the recompute")
    if shape_a != shape_b or forward != again:
        return "inputs-lost", (
            f"the re-run of {op['segment']} is not the same computation: at {where} the "
            f"forward ran {forward}, the recompute {again}: the recompute is given other "
            f"arguments than the forward (a keyword argument dropped or defaulted), or takes "
            f"another branch")
    if op.get("random"):
        return None
    return "inputs-lost", (
        f"the re-run of {op['segment']} computes other values from {where} on, a "
        f"deterministic op: the recompute is given other inputs than the forward (a keyword "
        f"argument dropped or defaulted, an input modified in place, a stale saved tensor)")


def _signature(text: str) -> tuple[str, str]:
    """'float32[2, 8]' -> ('float32', '[2, 8]'); an op name -> ('', name)."""
    if "[" in text:
        dtype, _, shape = text.partition("[")
        return dtype, "[" + shape
    return "", text


def _failing(record: dict[str, Any] | None) -> list[str]:
    if record is None:
        return []
    return [p["name"] for p in record.get("properties", []) if p.get("status") == "fail"]


def _texts(record: dict[str, Any] | None, name: str) -> list[str]:
    """A failing property's structure failures, then its failing tensors, worst first."""
    if record is None:
        return []
    for prop in record.get("properties", []):
        if prop["name"] == name:
            return [*prop.get("failures", []),
                    *(c["name"] for c in prop.get("checks", []) if not c.get("passed"))]
    return []


def _first_lines(record: dict[str, Any] | None) -> list[tuple[str, str]]:
    if record is None:
        return []
    return [(p["name"], p["summary"]) for p in record.get("properties", [])
            if p.get("status") == "fail" and p.get("summary")]


def _tensor(texts: list[str]) -> str:
    return texts[0].split(": ")[0] if texts else "a tensor"


def _generator(texts: list[str]) -> str:
    names = [t.rsplit(": ", 1)[-1] for t in texts if t.startswith("RNG state")]
    return f"the {names[0]} generator" if names else "a generator"


def fault_key(cause: str, sentence: str) -> str:
    """What tells two faults apart: the cause, and for an exception the exception (its type
    and message, numbers left out: a shape that differs by case is the same fault), so two
    different exceptions are two faults."""
    if cause != "raised":
        return cause
    raised = sentence.split(": ", 1)[-1]
    return f"raised: {re.sub(r'[0-9]+', 'N', raised)}"


#: Causes a declaration settles (``gradequiv_unsupported``): the implementation refuses, or
#: cannot serve, a way of training the user may never run; listed after the faults that
#: break the training they do run.
DECLARABLE = ("refuses-autograd-grad", "refuses-pattern", "grad-touched")


def distinct_faults(failures: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Every distinct fault among ``failures`` (minimal failures, named cases' among them),
    most important first: faults no declaration settles before those one does
    (``DECLARABLE``), and among each, those more failing cases show first; in a tie, the
    drawn minimal failures' causes in their order (each case's headline cause, then its
    further faults), then causes that only named cases showed. Each with the case that
    shows it first and the commands that replay it."""
    drawn = [f for f in failures if not str(f.get("test", "")).startswith("test_named_case")]
    named = [f for f in failures if str(f.get("test", "")).startswith("test_named_case")]
    found: dict[str, dict[str, str]] = {}
    seen: dict[str, set[str]] = {}  # fault -> the cases that show it
    numbers: dict[str, int] = {}
    for failure in [*drawn, *named]:
        diagnosis = failure.get("diagnosis") or {}
        test = str(failure.get("test", ""))
        if test.startswith("test_named_case"):
            where = f"named case {test.removeprefix('test_named_case[').removesuffix(']')}"
        else:
            number = numbers.setdefault(str(failure["reproduce"]), len(numbers) + 1)
            where = f"minimal failure {number}"
        parts = diagnosis.get("faults") or (
            [{"cause": diagnosis["cause"], "sentence": diagnosis["sentence"]}]
            if diagnosis.get("cause") else [])
        for part in parts:
            fault = {"cause": part["cause"], "sentence": part["sentence"],
                     "case": str(failure.get("description") or "case"), "found_in": where,
                     "reproduce": str(failure["reproduce"])}
            if failure.get("reproduce_file"):  # the short command, its case in a file
                fault["reproduce_file"] = str(failure["reproduce_file"])
            key = fault_key(part["cause"], part["sentence"])
            found.setdefault(key, fault)
            seen.setdefault(key, set()).add(str(failure["reproduce"]))
    order = list(found)
    return [found[key] for key in sorted(order, key=lambda k: (
        found[k]["cause"] in DECLARABLE, -len(seen[k]), order.index(k)))]
