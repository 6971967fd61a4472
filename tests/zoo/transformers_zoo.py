"""Hugging Face transformers: decoders (incl. MoE with the default ``grouped_mm`` experts),
encoders, seq2seq and vision models, as their users train them: ``labels=`` and the loss the
model computes, attention masks with padding, default attention implementation, dropout on."""

from __future__ import annotations

from typing import Any

import torch

from tests.zoo import Built, Entry

VOCAB = 128
BATCH, SEQ, PAD = 4, 64, 16  # the last PAD positions of every other row are padding
DROP = 0.1
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 128,
         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def model_loss(out: Any) -> torch.Tensor:
    """The loss the model computed from ``labels=``."""
    loss: torch.Tensor = out.loss
    return loss


def text(seed: int, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask with right padding on every other row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1::2, SEQ - PAD:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _build(model_cls: str, config_cls: str, seed: int, **config: Any) -> Any:
    import transformers as tf

    torch.manual_seed(seed)
    cfg = getattr(tf, config_cls)(**config)
    return getattr(tf, model_cls)(cfg).train()


def causal(model_cls: str, config_cls: str, **config: Any) -> Any:
    """A causal LM trained on padded text with ``labels=`` (-100 on padding)."""

    def build(seed: int) -> Built:
        model = _build(model_cls, config_cls, seed, **config)
        ids, mask = text(seed + 1)
        labels = ids.masked_fill(mask == 0, -100)
        return model, {"input_ids": ids, "attention_mask": mask,
                       "labels": labels}, model_loss
    return build


def masked_lm(model_cls: str, config_cls: str, **config: Any) -> Any:
    """Masked LM: 15% of the real tokens replaced by [MASK] (id 3) and predicted."""

    def build(seed: int) -> Built:
        model = _build(model_cls, config_cls, seed, **config)
        ids, mask = text(seed + 1)
        g = torch.Generator().manual_seed(seed + 2)
        chosen = (torch.rand(BATCH, SEQ, generator=g) < 0.15) & (mask == 1)
        chosen[:, 1] = True
        labels = ids.masked_fill(~chosen, -100)
        return model, {"input_ids": ids.masked_fill(chosen, 3),
                       "attention_mask": mask, "labels": labels}, model_loss
    return build


def classifier(model_cls: str, config_cls: str, **config: Any) -> Any:
    """Sequence classification into 3 classes with ``labels=``."""

    def build(seed: int) -> Built:
        model = _build(model_cls, config_cls, seed, num_labels=3, **config)
        ids, mask = text(seed + 1)
        labels = torch.randint(0, 3, (BATCH,), generator=torch.Generator().manual_seed(seed))
        return model, {"input_ids": ids, "attention_mask": mask,
                       "labels": labels}, model_loss
    return build


def seq2seq(model_cls: str, config_cls: str, **config: Any) -> Any:
    """Padded source text, target text as ``labels=`` (the model shifts them itself)."""

    def build(seed: int) -> Built:
        model = _build(model_cls, config_cls, seed, **config)
        ids, mask = text(seed + 1)
        target, target_mask = text(seed + 2)
        labels = target[:, : SEQ // 2].masked_fill(target_mask[:, : SEQ // 2] == 0, -100)
        return model, {"input_ids": ids, "attention_mask": mask,
                       "labels": labels}, model_loss
    return build


def whisper(seed: int) -> Built:
    model = _build("WhisperForConditionalGeneration", "WhisperConfig", seed, d_model=32,
                   encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                   decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   num_mel_bins=16, max_source_positions=32, max_target_positions=64,
                   vocab_size=VOCAB, dropout=DROP, attention_dropout=DROP,
                   activation_dropout=DROP, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   decoder_start_token_id=1)
    g = torch.Generator().manual_seed(seed + 1)
    features = torch.randn(BATCH, 16, 64, generator=g)
    labels = torch.randint(3, VOCAB, (BATCH, 24), generator=g)
    return model, {"input_features": features, "labels": labels}, model_loss


def image(model_cls: str, config_cls: str, size: int = 32, **config: Any) -> Any:
    """Image classification into 10 classes with ``labels=``."""

    def build(seed: int) -> Built:
        model = _build(model_cls, config_cls, seed, num_labels=10, **config)
        g = torch.Generator().manual_seed(seed + 1)
        pixels = torch.randn(BATCH, 3, size, size, generator=g)
        labels = torch.randint(0, 10, (BATCH,), generator=g)
        return model, {"pixel_values": pixels, "labels": labels}, model_loss
    return build


GQA = {**SMALL, "num_key_value_heads": 1, "attention_dropout": DROP}
MOE = {**GQA, "num_experts_per_tok": 2}
BERTISH = {**SMALL, "hidden_dropout_prob": DROP, "attention_probs_dropout_prob": DROP}
GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 2, "n_positions": 128, "vocab_size": VOCAB,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # dropouts default 0.1
BART = {"d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
        "vocab_size": VOCAB, "max_position_embeddings": 128, "dropout": DROP,
        "attention_dropout": DROP, "activation_dropout": DROP, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
T5 = {"d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2,
      "num_heads": 2, "vocab_size": VOCAB, "dropout_rate": DROP, "pad_token_id": 0,
      "eos_token_id": 2, "decoder_start_token_id": 0}
VIT: dict[str, Any] = {"image_size": 32, "patch_size": 4, "hidden_size": 32, "num_hidden_layers": 4,
       "num_attention_heads": 2, "intermediate_size": 64, "hidden_dropout_prob": DROP,
       "attention_probs_dropout_prob": DROP}

LIB = "transformers"
ENTRIES = [
    # decoders
    Entry("hf-llama", LIB, causal("LlamaForCausalLM", "LlamaConfig", **GQA)),
    Entry("hf-mistral", LIB, causal("MistralForCausalLM", "MistralConfig", **GQA,
                                    sliding_window=32)),
    Entry("hf-qwen2", LIB, causal("Qwen2ForCausalLM", "Qwen2Config", **GQA)),
    Entry("hf-qwen3", LIB, causal("Qwen3ForCausalLM", "Qwen3Config", **GQA, head_dim=16)),
    Entry("hf-gemma", LIB, causal("GemmaForCausalLM", "GemmaConfig", **GQA, head_dim=16)),
    Entry("hf-gemma2", LIB, causal("Gemma2ForCausalLM", "Gemma2Config", **GQA, head_dim=16,
                                   query_pre_attn_scalar=16, sliding_window=32)),
    Entry("hf-gemma3", LIB, causal("Gemma3ForCausalLM", "Gemma3TextConfig", **GQA,
                                   head_dim=16, query_pre_attn_scalar=16, sliding_window=32)),
    # per-layer inputs projected by a matmul scaled in place, AltUp, LAuReL
    Entry("hf-gemma3n", LIB, causal("Gemma3nForCausalLM", "Gemma3nTextConfig", **GQA,
                                    head_dim=16, hidden_size_per_layer_input=8,
                                    vocab_size_per_layer_input=VOCAB, laurel_rank=4,
                                    altup_num_inputs=2, num_kv_shared_layers=0,
                                    activation_sparsity_pattern=[0.0] * 4, sliding_window=16,
                                    layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    Entry("hf-phi", LIB, causal("PhiForCausalLM", "PhiConfig", **GQA, resid_pdrop=DROP,
                                embd_pdrop=DROP)),
    Entry("hf-phi3", LIB, causal("Phi3ForCausalLM", "Phi3Config", **GQA, resid_pdrop=DROP,
                                 embd_pdrop=DROP)),
    Entry("hf-gpt-neox", LIB, causal("GPTNeoXForCausalLM", "GPTNeoXConfig", **SMALL,
                                     hidden_dropout=DROP, attention_dropout=DROP)),
    Entry("hf-falcon", LIB, causal("FalconForCausalLM", "FalconConfig", **SMALL,
                                   hidden_dropout=DROP, attention_dropout=DROP)),
    Entry("hf-bloom", LIB, causal("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=4,
                                  n_head=2, vocab_size=VOCAB, hidden_dropout=DROP,
                                  attention_dropout=DROP, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)),
    Entry("hf-gpt2", LIB, causal("GPT2LMHeadModel", "GPT2Config", **GPT2)),
    # called positionally, its decorator's use_cache went astray: it takes its batch by keyword
    Entry("hf-xglm", LIB, causal("XGLMForCausalLM", "XGLMConfig", d_model=32, ffn_dim=64,
                                 num_layers=4, attention_heads=2, vocab_size=VOCAB,
                                 max_position_embeddings=128, dropout=DROP,
                                 attention_dropout=DROP, activation_dropout=DROP,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Entry("hf-opt", LIB, causal("OPTForCausalLM", "OPTConfig", hidden_size=32, ffn_dim=64,
                                num_hidden_layers=4, num_attention_heads=2, vocab_size=VOCAB,
                                max_position_embeddings=128, word_embed_proj_dim=32,
                                dropout=DROP, attention_dropout=DROP, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2)),
    Entry("hf-gptj", LIB, causal("GPTJForCausalLM", "GPTJConfig", n_layer=4, n_embd=32,
                                 n_head=2, rotary_dim=8, n_positions=128, vocab_size=VOCAB,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Entry("hf-stablelm", LIB, causal("StableLmForCausalLM", "StableLmConfig", **GQA,
                                     hidden_dropout=DROP)),
    Entry("hf-olmo", LIB, causal("OlmoForCausalLM", "OlmoConfig", **GQA)),
    # a recurrence written a step at a time into slices of its output (RG-LRU), stateful
    Entry("hf-recurrent-gemma", LIB, causal("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                                            hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=3, num_attention_heads=2,
                                            vocab_size=VOCAB, lru_width=32,
                                            attention_window_size=16, pad_token_id=0)),
    # multi-query attention in one fused projection; local and global attention layers
    Entry("hf-gpt-bigcode", LIB, causal("GPTBigCodeForCausalLM", "GPTBigCodeConfig", **GQA)),
    Entry("hf-gpt-neo", LIB, causal("GPTNeoForCausalLM", "GPTNeoConfig", **GQA, num_layers=4,
                                    attention_types=[[["global", "local"], 2]],
                                    window_size=16)),
    Entry("hf-modernbert-decoder", LIB, causal("ModernBertDecoderForCausalLM",
                                               "ModernBertDecoderConfig", **GQA,
                                               global_attn_every_n_layers=2,
                                               local_attention=16)),
    # attention and the MLP side by side on one normed input
    Entry("hf-cohere", LIB, causal("CohereForCausalLM", "CohereConfig", **GQA)),
    # hybrids of attention with short convolutions, and with linear attention
    Entry("hf-lfm3", LIB, causal("Lfm3ForCausalLM", "Lfm3Config", **GQA)),
    Entry("hf-olmo-hybrid", LIB, causal("OlmoHybridForCausalLM", "OlmoHybridConfig", **GQA,
                                        head_dim=16)),
    # state-space models: the selective scan a step at a time (torch's path, no fused kernel)
    Entry("hf-mamba", LIB, causal("MambaForCausalLM", "MambaConfig", **GQA, state_size=8,
                                  expand=2, conv_kernel=4)),
    Entry("hf-mamba2", LIB, causal("Mamba2ForCausalLM", "Mamba2Config", **GQA, num_heads=4,
                                   head_dim=16, state_size=8, n_groups=1, expand=2,
                                   chunk_size=16)),
    # a hybrid: attention, Mamba and expert layers interleaved
    Entry("hf-jamba", LIB, causal("JambaForCausalLM", "JambaConfig", **GQA, num_experts=4,
                                  num_experts_per_tok=2, attn_layer_period=2,
                                  attn_layer_offset=1, expert_layer_period=2,
                                  expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=4,
                                  mamba_expand=2, use_mamba_kernels=False)),
    # mixtures of experts (the default experts implementation, grouped_mm)
    Entry("hf-mixtral", LIB, causal("MixtralForCausalLM", "MixtralConfig", **MOE,
                                    num_local_experts=4)),
    Entry("hf-qwen3-moe", LIB, causal("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **MOE,
                                      head_dim=16, num_experts=4, moe_intermediate_size=32)),
    Entry("hf-qwen2-moe", LIB, causal("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **MOE,
                                      num_experts=4, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=32)),
    Entry("hf-olmoe", LIB, causal("OlmoeForCausalLM", "OlmoeConfig", **MOE, num_experts=4)),
    Entry("hf-jetmoe", LIB, causal("JetMoeForCausalLM", "JetMoeConfig", **MOE,
                                   num_local_experts=4, kv_channels=16)),  # sizes by tolist
    # latent attention (keys built by copy_ into slices of new_empty) and grouped routing
    Entry("hf-deepseek-v3", LIB, causal("DeepseekV3ForCausalLM", "DeepseekV3Config",
                                        **{**MOE, "num_key_value_heads": 2},
                                        n_routed_experts=4, moe_intermediate_size=32,
                                        first_k_dense_replace=1, q_lora_rank=16,
                                        kv_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=16, n_group=2,
                                        topk_group=1)),
    # encoders
    Entry("hf-bert", LIB, masked_lm("BertForMaskedLM", "BertConfig", **BERTISH)),
    Entry("hf-megatron-bert", LIB, masked_lm("MegatronBertForMaskedLM", "MegatronBertConfig",
                                             **BERTISH)),  # pre-LN
    Entry("hf-roberta", LIB, classifier("RobertaForSequenceClassification", "RobertaConfig",
                                        **BERTISH)),
    Entry("hf-deberta-v2", LIB, classifier("DebertaV2ForSequenceClassification",
                                           "DebertaV2Config", **BERTISH)),
    Entry("hf-distilbert", LIB, masked_lm("DistilBertForMaskedLM", "DistilBertConfig", dim=32,
                                          hidden_dim=64, n_layers=4, n_heads=2,
                                          vocab_size=VOCAB, max_position_embeddings=128,
                                          dropout=DROP, attention_dropout=DROP, pad_token_id=0)),
    Entry("hf-albert", LIB, classifier("AlbertForSequenceClassification", "AlbertConfig",
                                       **BERTISH, embedding_size=16)),
    Entry("hf-electra", LIB, classifier("ElectraForSequenceClassification", "ElectraConfig",
                                        **BERTISH, embedding_size=16)),
    # encoder-decoders
    Entry("hf-t5", LIB, seq2seq("T5ForConditionalGeneration", "T5Config", **T5)),
    Entry("hf-bart", LIB, seq2seq("BartForConditionalGeneration", "BartConfig", **BART)),
    # its masks' eager path (no padding in the labels) differs from transformers' trace path
    Entry("hf-m2m100", LIB, seq2seq("M2M100ForConditionalGeneration", "M2M100Config", **BART)),
    Entry("hf-whisper", LIB, whisper),
    # vision
    Entry("hf-vit", LIB, image("ViTForImageClassification", "ViTConfig", **VIT)),
    Entry("hf-dinov2", LIB, image("Dinov2ForImageClassification", "Dinov2Config", **VIT,
                                  drop_path_rate=DROP)),
    Entry("hf-convnext", LIB, image("ConvNextForImageClassification", "ConvNextConfig",
                                    size=64, hidden_sizes=[16, 32, 64, 128],
                                    depths=[1, 1, 2, 1], drop_path_rate=DROP)),
    Entry("hf-swin", LIB, image("SwinForImageClassification", "SwinConfig", image_size=32,
                                patch_size=2, embed_dim=16, depths=[2, 2], num_heads=[1, 2],
                                window_size=4, hidden_dropout_prob=DROP,
                                attention_probs_dropout_prob=DROP, drop_path_rate=DROP)),
]
