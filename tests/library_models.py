"""Tiny models of the libraries people train with, built in code from configs (no download),
for ``--model library_models:NAME``: transformers (a decoder, an encoder, an
encoder-decoder), a PEFT LoRA on a tiny decoder, a diffusers UNet. Each needs its library
(the tests skip without it)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gradequiv.models import UserModel

VOCAB, WIDTH, SEQ, BATCH = 64, 32, 8, 2


def _quiet_import(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return __import__(name)


def _tokens(seed: int, length: int = SEQ) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (BATCH, length + 1), generator=gen)
    return stream[:, :-1].clone(), stream[:, 1:].clone()


def _logits_loss(outputs: Any, targets: Tensor) -> Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _hidden_loss(outputs: Any, targets: Tensor) -> Tensor:
    return (outputs.last_hidden_state.float() * targets).mean()


def _decoder(kind: str, seed: int, *, layers: int, kv_heads: int) -> torch.nn.Module:
    """A tiny ``{kind}ForCausalLM`` (eager attention, attention dropout 0.1)."""
    transformers = _quiet_import("transformers")
    config = getattr(transformers, f"{kind}Config")(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=kv_heads,
        max_position_embeddings=SEQ, attention_dropout=0.1, attn_implementation="eager",
        use_cache=False)
    torch.manual_seed(seed)
    model: torch.nn.Module = getattr(transformers, f"{kind}ForCausalLM")(config)
    return model


def qwen2(seed: int) -> UserModel:
    """A 2-layer Qwen2 decoder (eager attention, attention dropout 0.1); its decoder
    layers named by class."""
    transformers = _quiet_import("transformers")
    model = _decoder("Qwen2", seed, layers=2, kv_heads=1)
    tokens, targets = _tokens(seed)
    return UserModel(model, {"input_ids": tokens}, targets, _logits_loss,
                     segments=[transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer])


def bert(seed: int) -> UserModel:
    """A 2-layer BERT encoder with dropout 0.1 and a padded batch (attention mask by
    keyword); its layers named by class."""
    transformers = _quiet_import("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * WIDTH, max_position_embeddings=SEQ, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.BertModel(config, add_pooling_layer=False)
    tokens, _ = _tokens(seed)
    mask = torch.ones_like(tokens)
    mask[1, -2:] = 0  # padding
    weights = torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(seed))
    return UserModel(model, {"input_ids": tokens, "attention_mask": mask}, weights,
                     _hidden_loss,
                     segments=[transformers.models.bert.modeling_bert.BertLayer])


def t5(seed: int) -> UserModel:
    """A T5 with one encoder and one decoder block (dropout 0.1), called by keyword; its
    blocks named by class."""
    transformers = _quiet_import("transformers")
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=2 * WIDTH, num_layers=2,
        num_decoder_layers=2, num_heads=2, dropout_rate=0.1, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config)
    tokens, _ = _tokens(seed)
    decoder, targets = _tokens(seed + 1, SEQ // 2)
    return UserModel(model, {"input_ids": tokens, "decoder_input_ids": decoder}, targets,
                     _logits_loss, segments=[transformers.models.t5.modeling_t5.T5Block])


def lora_llama(seed: int) -> UserModel:
    """A LoRA (rank 4, dropout 0.1) on a 2-layer Llama's attention projections, its base
    frozen (PEFT's names: every one under base_model.model.); the decoder layers by
    class."""
    transformers = _quiet_import("transformers")
    peft = _quiet_import("peft")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
        attn_implementation="eager", use_cache=False)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                           target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    with warnings.catch_warnings():
        # PEFT 0.21 reads transformers' is_gradient_checkpointing, which transformers 5.25
        # deprecates with a FutureWarning (PEFT's own call, not the model's or ours)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated",
                                FutureWarning)
        model = peft.get_peft_model(base, lora)
    tokens, targets = _tokens(seed)
    return UserModel(model, {"input_ids": tokens}, targets, _logits_loss,
                     segments=[transformers.models.llama.modeling_llama.LlamaDecoderLayer])


def unet(seed: int) -> UserModel:
    """A diffusers UNet2DModel of two levels (dropout 0.1, 8x8 images, a timestep); its
    segments: the resnets diffusers checkpoints inside its down and up blocks."""
    diffusers = _quiet_import("diffusers")
    torch.manual_seed(seed)
    model = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), norm_num_groups=4, dropout=0.1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"))
    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(BATCH, 3, 8, 8, generator=gen)
    noise = torch.randn(BATCH, 3, 8, 8, generator=gen)
    # diffusers checkpoints the resnets inside its down and up blocks (the mid block's it
    # runs plainly): those, found by class
    resnets = [name for name, m in model.named_modules()
               if isinstance(m, diffusers.models.resnet.ResnetBlock2D)
               and not name.startswith("mid_block.")]
    return UserModel(model, (sample, torch.tensor([10, 500])), noise,
                     lambda out, target: F.mse_loss(out.sample.float(), target),
                     segments=resnets)


def diffusers_checkpointing(model: torch.nn.Module) -> None:
    """diffusers' own switch, as its users turn it on; it picks its own segments."""
    model.enable_gradient_checkpointing()


def llama4(seed: int) -> UserModel:
    """A 4-layer Llama (eager attention, attention dropout 0.1), enough layers for
    ``every_n_layers`` and ``every:K`` to pick different ones; its decoder layers."""
    model = _decoder("Llama", seed, layers=4, kv_heads=2)
    tokens, targets = _tokens(seed)
    return UserModel(model, (tokens,), targets, _logits_loss,
                     segments=[f"model.layers.{i}" for i in range(4)])


def every_layer_said_every_second(model: torch.nn.Module) -> list[str]:
    """A toggle that checkpoints every layer but says it checkpoints every second one: the
    layers it leaves out by its word re-run all the same."""
    model.activation_checkpointing_enable(  # type: ignore[operator]
        activation_checkpointing_kwargs={"use_reentrant": False})
    return [f"model.layers.{i}" for i in range(0, 4, 2)]


def pins_host_memory() -> bool:
    """Whether torch can pin host memory here (it cannot without an accelerator), which
    transformers 5.25's offload asks for."""
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError:
        return False
    return True
