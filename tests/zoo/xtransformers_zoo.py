"""x-transformers (lucidrains): a decoder under its AutoregressiveWrapper (the wrapper returns
the loss), an encoder and a ViT with losses closed over their targets, and the
encoder-decoder XTransformer with a padded source mask."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.zoo import Built, Entry

TOKENS, SEQ, BATCH, DIM, DROP = 128, 64, 4, 32, 0.1
LAYERS = {"dim": DIM, "depth": 4, "heads": 2, "attn_dropout": DROP, "ff_dropout": DROP}


def returned_loss(out: Any) -> torch.Tensor:
    """The wrappers compute the loss in their forward."""
    loss: torch.Tensor = out
    return loss


def _tokens(seed: int, length: int = SEQ) -> torch.Tensor:
    return torch.randint(1, TOKENS, (BATCH, length), generator=torch.Generator().manual_seed(seed))


def _padding_mask() -> torch.Tensor:
    mask = torch.ones(BATCH, SEQ, dtype=torch.bool)
    mask[1::2, SEQ - 16:] = False
    return mask


def decoder(**layers: Any) -> Any:
    def build(seed: int) -> Built:
        from x_transformers import AutoregressiveWrapper, Decoder, TransformerWrapper

        torch.manual_seed(seed)
        model = AutoregressiveWrapper(TransformerWrapper(
            num_tokens=TOKENS, max_seq_len=SEQ, emb_dropout=DROP,
            attn_layers=Decoder(**LAYERS, **layers))).train()
        return model, (_tokens(seed + 1),), returned_loss
    return build


def encoder(seed: int) -> Built:
    """Token classification (e.g. tagging): cross entropy over labels, padding ignored."""
    from x_transformers import Encoder, TransformerWrapper

    torch.manual_seed(seed)
    model = TransformerWrapper(num_tokens=TOKENS, max_seq_len=SEQ, logits_dim=5, emb_dropout=DROP,
                               attn_layers=Encoder(**LAYERS)).train()
    mask = _padding_mask()
    labels = torch.randint(0, 5, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 2))
    labels = labels.masked_fill(~mask, -100)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100)

    return model, {"x": _tokens(seed + 1), "mask": mask}, loss_fn


def encoder_decoder(seed: int) -> Built:
    from x_transformers import XTransformer

    torch.manual_seed(seed)
    model = XTransformer(dim=DIM, tie_token_emb=True, enc_num_tokens=TOKENS, enc_depth=2,
                         enc_heads=2, enc_max_seq_len=SEQ, enc_attn_dropout=DROP,
                         enc_ff_dropout=DROP, dec_num_tokens=TOKENS, dec_depth=2, dec_heads=2,
                         dec_max_seq_len=SEQ, dec_attn_dropout=DROP, dec_ff_dropout=DROP).train()
    return model, (_tokens(seed + 1), _tokens(seed + 2, SEQ // 2), _padding_mask()), returned_loss


def vit(seed: int) -> Built:
    from x_transformers import Encoder, ViTransformerWrapper

    torch.manual_seed(seed)
    model = ViTransformerWrapper(image_size=32, patch_size=4, num_classes=10, emb_dropout=DROP,
                                 attn_layers=Encoder(**LAYERS)).train()
    g = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(BATCH, 3, 32, 32, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    return model, (images,), lambda logits: F.cross_entropy(logits, labels)


LIB = "x_transformers"
ENTRIES = [
    Entry("xt-decoder", LIB, decoder()),
    Entry("xt-decoder-rotary", LIB, decoder(rotary_pos_emb=True, use_rmsnorm=True,
                                            attn_kv_heads=1, ff_glu=True)),
    Entry("xt-encoder", LIB, encoder),
    Entry("xt-enc-dec", LIB, encoder_decoder),
    Entry("xt-vit", LIB, vit),
]
