"""MONAI: 2-D segmentation networks (InstanceNorm + in-place LeakyReLU where the library
defaults to it) trained with MONAI's Dice losses closed over the label maps."""

from __future__ import annotations

from typing import Any

import torch

from tests.zoo import Built, Entry

BATCH, SIZE, CLASSES, DROP = 4, 64, 3, 0.1


def segmentation(make: Any, loss: str = "DiceCELoss", size: int = SIZE) -> Any:
    """``make()`` builds the network; the loss is MONAI's, on integer label maps."""

    def build(seed: int) -> Built:
        import monai.losses

        torch.manual_seed(seed)
        model = make().train()
        g = torch.Generator().manual_seed(seed + 1)
        images = torch.randn(BATCH, 1, size, size, generator=g)
        labels = torch.randint(0, CLASSES, (BATCH, 1, size, size), generator=g)
        criterion = getattr(monai.losses, loss)(to_onehot_y=True, softmax=True)
        return model, (images,), lambda logits: criterion(logits, labels)
    return build


def unet() -> Any:
    from monai.networks.nets.unet import UNet

    return UNet(spatial_dims=2, in_channels=1, out_channels=CLASSES, channels=(8, 16, 32, 64),
                strides=(2, 2, 2), num_res_units=2, norm="INSTANCE",
                act=("LeakyReLU", {"inplace": True}), dropout=DROP)


def basic_unet() -> Any:
    from monai.networks.nets.basic_unet import BasicUNet

    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=CLASSES,
                     features=(8, 8, 16, 32, 64, 8), dropout=DROP)


def dyn_unet() -> Any:
    from monai.networks.nets.dynunet import DynUNet

    return DynUNet(spatial_dims=2, in_channels=1, out_channels=CLASSES,
                   kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2],
                   upsample_kernel_size=[2, 2, 2], filters=[8, 16, 32, 64], dropout=DROP,
                   res_block=True)


def swin_unetr() -> Any:
    from monai.networks.nets.swin_unetr import SwinUNETR

    return SwinUNETR(in_channels=1, out_channels=CLASSES, spatial_dims=2, feature_size=12,
                     depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), window_size=4,
                     drop_rate=DROP, attn_drop_rate=DROP)


def unetr() -> Any:
    from monai.networks.nets.unetr import UNETR

    return UNETR(in_channels=1, out_channels=CLASSES, img_size=(32, 32), feature_size=8,
                 hidden_size=32, mlp_dim=64, num_heads=2, spatial_dims=2, dropout_rate=DROP)


def seg_resnet() -> Any:
    from monai.networks.nets.segresnet import SegResNet

    return SegResNet(spatial_dims=2, init_filters=8, in_channels=1, out_channels=CLASSES,
                     dropout_prob=DROP)


LIB = "monai"
ENTRIES = [
    Entry("monai-unet", LIB, segmentation(unet, "DiceLoss")),
    Entry("monai-basicunet", LIB, segmentation(basic_unet)),
    Entry("monai-dynunet", LIB, segmentation(dyn_unet)),
    Entry("monai-swinunetr", LIB, segmentation(swin_unetr)),
    Entry("monai-unetr", LIB, segmentation(unetr, "DiceLoss", size=32)),
    Entry("monai-segresnet", LIB, segmentation(seg_resnet)),
]
