"""The names a case's JSON uses for its model and its training, torch-free: the option
parser and the implementations read them too.

A case names its model in its JSON (``model_kind``); ``--gradequiv-models`` picks
among the reference models by the same names.
"""

from __future__ import annotations

__all__ = ["ACCUMULATED_MICRO_BATCHES", "BACKWARD_AUTOCAST", "BATCHNORM", "CASE_FEATURES",
           "DRAWN_MODELS", "DTYPES", "EXTERNAL", "GRAD_MODES", "INPLACE_OPS", "MODEL_KINDS",
           "OPT_IN_GRAD_MODES", "PIPELINE_SCHEDULE_NAMES", "RETAIN_GRAPH", "SCHEDULES",
           "SCHEDULE_MICRO_BATCHES", "TRAINABLE", "TRANSFORMER"]

TRANSFORMER = "transformer"  # the reference transformer (models/transformer.py)
BATCHNORM = "batchnorm"  # the BatchNorm MLP of the buffers property (models/batchnorm.py)
EXTERNAL = "external"  # a user's model, named with --model (models/external.py)

#: Every kind a case can hold (report.schema.json lists the same).
MODEL_KINDS = (TRANSFORMER, BATCHNORM, EXTERNAL)
#: The reference models cases are drawn for; ``external`` is a user's model, named with
#: ``--model`` instead.
DRAWN_MODELS = (TRANSFORMER, BATCHNORM)

#: How a case asks for gradients each step, cheapest first: ``loss.backward()``;
#: ``torch.autograd.grad`` (meta-learning: no ``.grad`` may be touched); two micro-batches
#: accumulated before the optimizer step; a gradient penalty, whose gradients are taken with
#: ``create_graph=True`` and backpropagated again (double backward).
GRAD_MODES = ("backward", "autograd-grad", "accumulate", "create-graph")
#: Precision regimes. Autocast ones keep fp32 weights and fp32 gradients; ``bf16-model``
#: casts the model itself (weights, gradients and float inputs in bfloat16, no autocast).
DTYPES = ("fp32", "bf16-autocast", "fp16-autocast", "bf16-model")
#: The grad modes an implementation gets only where it claims them (``gradequiv_supports``
#: on its target); every other mode it gets unless it refuses it (``gradequiv_unsupported``).
#: Double backward is opt-in: reentrant checkpoints cannot run it by design, and selective
#: activation checkpoint refuses a second backward over a region.
OPT_IN_GRAD_MODES = ("create-graph",)
#: What else a case may have that an implementation may refuse by design, loudly, and
#: declare in ``gradequiv_unsupported``: in-place ops on intermediates. (torch's selective
#: checkpoint raises "Tensor cached during selective activation checkpoint has been
#: mutated" only where one moves the version counter of an output its policy saved, and is
#: silently wrong elsewhere, so it declares nothing.)
INPLACE_OPS = "inplace-ops"

#: How a step drives its micro-batches, cheapest first: ``one`` (each micro-batch's forward,
#: then its backward: one batch, or two under ``accumulate``); ``gpipe`` (every forward, then
#: every backward in the forwards' order); ``gpipe-reverse`` (the backwards in reverse);
#: ``1f1b`` (a pipeline stage's one-forward-one-backward: four forwards in flight, then a new
#: forward after each backward); ``summed`` (every forward, one backward of the summed loss,
#: as data-parallel code often does).
SCHEDULES = ("one", "gpipe", "gpipe-reverse", "1f1b", "summed")
#: torch.distributed.pipelining's schedules, by the names ``--schedule`` and a training
#: regime's ``pipeline-schedules`` take (their classes: ``harness/engine/schedules.py``).
PIPELINE_SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs",
                           "interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")
#: Micro-batches per optimizer step under ``accumulate`` (with the schedule ``one``).
ACCUMULATED_MICRO_BATCHES = 2
#: Micro-batches per optimizer step under each schedule but ``one``.
SCHEDULE_MICRO_BATCHES = {"gpipe": 4, "gpipe-reverse": 4, "1f1b": 6, "summed": 4}
#: Several backward passes over one forward (``backward_passes`` > 1): the loss split in parts
#: backpropagated in turn, ``retain_graph=True`` on all but the last.
RETAIN_GRAPH = "retain-graph"
#: The backward run inside an autocast block (``backward_autocast``): the forward's autocast
#: where it has one, bf16 autocast around an fp32 forward otherwise.
BACKWARD_AUTOCAST = "backward-autocast"
#: Which parameters train (partial fine-tuning), cheapest first: ``all``; ``frozen-layer``
#: (the first segment's parameters ``requires_grad=False``: a segment with nothing to train
#: before trainable ones); ``adapters`` (only the reference transformer's LoRA pairs and
#: steering vectors train, its embeddings' output made to require grad as transformers'
#: ``enable_input_require_grads`` does); ``changing`` (the first segment frozen on odd
#: steps, trained on even ones: which parameters train is a fact of each call).
TRAINABLE = ("all", "frozen-layer", "adapters", "changing")
#: What else a case may have that an implementation may refuse by design, loudly, and
#: declare in ``gradequiv_unsupported``.
CASE_FEATURES = (INPLACE_OPS, *SCHEDULES[1:], RETAIN_GRAPH, BACKWARD_AUTOCAST, *TRAINABLE[1:])
