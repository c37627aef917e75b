"""A CIFAR-10-shaped task on torchvision's FakeData: the model, the data and the classic loop.

Everything here is importable at module level, so it can travel to a child process
(``torch_hang.run``, ``torch_hang.dataloader``, ``torch_hang.distributed``). torchvision is
imported only where the data is built: it adds about 2 s to the start of every fresh interpreter,
and a child that only needs the model should not pay for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
# CIFAR-10's per-channel statistics: the transforms are the real ones, only the pixels are fake.
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


class CifarNet(nn.Module):
    """One convolution, a ReLU and a linear head: 3x32x32 images in, 10 class scores out."""

    def __init__(self, channels: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(IMAGE_SHAPE[0], channels, kernel_size=3, padding=1)
        self.relu = nn.ReLU()
        self.head = nn.Linear(channels * IMAGE_SHAPE[1] * IMAGE_SHAPE[2], NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.relu(self.conv(images)), 1))


def fake_cifar(size: int = 512, *, augment: bool = True) -> Dataset[tuple[torch.Tensor, int]]:
    """FakeData shaped like CIFAR-10, through the usual CIFAR transforms (``augment``: training's)."""
    from torchvision import transforms
    from torchvision.datasets import FakeData

    augmentation = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
    return FakeData(
        size=size,
        image_size=IMAGE_SHAPE,
        num_classes=NUM_CLASSES,
        transform=transforms.Compose(
            [
                *(augmentation if augment else []),
                transforms.ToTensor(),
                transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
            ]
        ),
    )


def cifar_loader(
    size: int = 512,
    *,
    batch_size: int = 128,
    num_workers: int = 4,
    pin_memory: bool = False,
    augment: bool = True,
) -> DataLoader[tuple[torch.Tensor, int]]:
    """The loader of the classic loop: shuffled batches of 128 from 4 worker processes."""
    return DataLoader(
        fake_cifar(size, augment=augment),
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        pin_memory=pin_memory,
    )


@dataclass
class TrainResult:
    """What a few steps of training did, small enough to send back from a child process."""

    device: str
    data_parallel: bool
    losses: list[float] = field(default_factory=list)
    samples: int = 0

    @property
    def finite(self) -> bool:
        return all(math.isfinite(loss) for loss in self.losses)


def train(
    steps: int = 4,
    *,
    size: int = 512,
    batch_size: int = 128,
    num_workers: int = 4,
    device: str | None = None,
    augment: bool = True,
    seed: int = 0,
) -> TrainResult:
    """The classic loop: SGD with momentum and cross-entropy, over as many epochs as ``steps`` needs.

    The model goes to the GPU when one is visible (``device=None``), and is wrapped in
    ``nn.DataParallel`` when more than one is.
    """
    torch.manual_seed(seed)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model: nn.Module = CifarNet().to(target)
    data_parallel = target.type == "cuda" and torch.cuda.device_count() > 1
    if data_parallel:
        model = nn.DataParallel(model)
    loader = cifar_loader(
        size,
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=target.type == "cuda",
        augment=augment,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    result = TrainResult(device=str(target), data_parallel=data_parallel)
    model.train()
    while len(result.losses) < steps:
        for images, labels in loader:
            images = images.to(target, non_blocking=True)
            labels = labels.to(target, non_blocking=True)
            optimizer.zero_grad()
            loss = criterion(model(images), labels)
            loss.backward()
            optimizer.step()
            result.losses.append(loss.item())
            result.samples += len(labels)
            if len(result.losses) == steps:
                break
    return result
