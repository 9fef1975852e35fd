"""The seed's worked example, measured: per-layer recompute against full storage over depth.

The seed's unit model: each layer holds 10 units of activations and its
boundary input 1 unit; per-layer recompute keeps L boundaries plus one
layer's internals while it is recomputed, (L + 10) / 10L of full storage
(42 / 320 = 13% at 32 layers), for one extra forward: 3F -> 4F, +33%.

Here the same ratios are measured on the reference transformer with
``gradequiv.harness.commands.profiling`` (the boundary and per-layer units are measured
too), side by side with the unit model's prediction. Usage:

    python ci/layer_sweep.py > docs/layer-sweep.md
"""

from __future__ import annotations

import sys

import torch

from gradequiv.harness import Case, resolve
from gradequiv.harness.commands.profiling import profile
from gradequiv.harness.engine.analytic import layer_bytes
from gradequiv.models import BatchConfig, TransformerConfig, parse_granularity

LAYERS = (4, 8, 16, 32)
WIDTH, HEADS, SEQ, BATCH = 64, 4, 64, 4
STEPS, WARMUP = 10, 2


def _model(n_layer: int) -> TransformerConfig:
    return TransformerConfig(n_layer=n_layer, n_embd=WIDTH, n_head=HEADS, max_seq_len=SEQ,
                             embd_dropout=0.1, attn_dropout=0.1, resid_dropout=0.1,
                             mlp_dropout=0.1)


def main() -> int:
    impl = resolve("torch")
    granularities = [parse_granularity("none"), parse_granularity("layer")]
    rows = []
    batch = BatchConfig(BATCH, SEQ, padding=False)
    for n_layer in LAYERS:
        case = Case(model=_model(n_layer), batch=batch)
        none, layer = profile(impl, case, granularities, steps=STEPS, warmup=WARMUP).rows
        print(f"L={n_layer} done", file=sys.stderr, flush=True)
        rows.append((n_layer, none, layer))
    boundary = BATCH * SEQ * WIDTH * 4  # one fp32 layer input
    per_layer = (rows[-1][1].held_bytes - rows[0][1].held_bytes) / (LAYERS[-1] - LAYERS[0])
    units = per_layer / boundary
    print("# Per-layer recompute over depth: the seed's example, measured\n")
    print(f"Command: `python ci/layer_sweep.py > docs/layer-sweep.md`. Conditions: torch "
          f"{torch.__version__}, CPU, {torch.get_num_threads()} threads, fp32, reference "
          f"transformer {WIDTH} wide, {HEADS} heads, {SEQ} tokens x batch {BATCH}, dropout 0.1 "
          f"at every site, `torch.utils.checkpoint` (non-reentrant) on every layer; "
          f"{STEPS} timed steps after {WARMUP} warm-up, interleaved with the full-storage "
          f"steps.\n")
    analytic = layer_bytes(_model(1), batch)
    print(f"Measured units: a layer's boundary input is {boundary:,} bytes; a layer holds "
          f"{per_layer:,.0f} bytes under full storage (the op-derived model of "
          f"docs/analytic-model.md: {analytic:,}), **{units:.1f} boundary units** "
          f"(the seed assumes 10).\n")
    print("## Memory\n")
    print("| layers | full storage bytes | recompute: held between fwd and bwd | fraction | "
          "unit model 1/u | recompute: peak in backward | fraction | unit model (L+u)/uL | "
          "seed's (L+10)/10L |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n_layer, none, layer in rows:
        seed = (n_layer + 10) / (10 * n_layer)
        print(f"| {n_layer} | {none.held_bytes:,} | {layer.held_bytes:,} | "
              f"{layer.held_bytes / none.held_bytes:.1%} | {1 / units:.1%} | "
              f"{layer.peak_backward_bytes:,} | "
              f"{layer.peak_backward_bytes / none.held_bytes:.1%} | "
              f"{(n_layer + units) / (units * n_layer):.1%} | {seed:.1%} |")
    print("\nu is the measured number of boundary units a layer holds. Held bytes are "
          "what stays alive between forward and backward: the L boundaries, plus the "
          "embedding output every layer mixes back in and the loss's own tensors, hence a "
          "little above 1/u. The peak adds what a recompute creates while backward needs "
          "it, the seed's 'one layer being recomputed' (its 42/320 is this column's "
          "model); gradients are left out.\n")
    print("## Time (p50 ms)\n")
    print("| layers | full: forward | full: backward | full: backward / forward | recompute: "
          "forward | recompute: backward | of which recompute | recompute / full forward | "
          "step overhead measured | if recompute were the only cost | seed's 3F->4F |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n_layer, none, layer in rows:
        full_step = none.forward_s + none.backward_s
        print(f"| {n_layer} | {none.forward_s * 1e3:.1f} | {none.backward_s * 1e3:.1f} | "
              f"{none.backward_s / none.forward_s:.2f} | "
              f"{layer.forward_s * 1e3:.1f} | {layer.backward_s * 1e3:.1f} | "
              f"{layer.recompute_s * 1e3:.1f} | {layer.recompute_s / none.forward_s:.2f} | "
              f"{layer.overhead_vs_none:+.1%} | {layer.recompute_s / full_step:+.1%} | +33% |")
    _, none, layer = rows[-1]
    extra_forward = layer.forward_s - none.forward_s
    extra_backward = layer.backward_s - layer.recompute_s - none.backward_s
    print("\nBackward includes the optimizer step. 'Of which recompute' is the time spent "
          "inside the layers' forwards while backward runs (forward hooks on the "
          "checkpointed layers, `gradequiv.harness.commands.profiling`); 'if recompute were the "
          "only cost' adds just that to the full-storage step.\n")
    share = layer.recompute_s / (none.forward_s + none.backward_s)
    print(f"Why the overhead is not the seed's +33%: its model prices backward at two "
          f"forwards (step 3F, recompute +1F). Here, on a 2-core CPU with small matrices, "
          f"backward (with the optimizer step) costs {none.backward_s / none.forward_s:.2f} "
          f"of a forward at {LAYERS[-1]} layers, so the recompute alone adds {share:+.0%} "
          f"to a step. The rest is the checkpoint's own work: "
          f"{extra_forward * 1e3:+.1f} ms in forward and {extra_backward * 1e3:+.1f} ms in "
          f"backward outside the recompute.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
