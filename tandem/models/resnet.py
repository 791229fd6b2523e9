"""ResNet-18/34/50 (He et al. 2015, "Deep Residual Learning"), in plain torch.nn.

The topology matches the paper and torchvision's v1.5 variant (the stride of a
Bottleneck sits on its 3x3 conv, not the first 1x1), so parameter counts match:
resnet18 = 11,689,512 and resnet50 = 25,557,032 at width 64, 1000 classes, 224 px.

``width`` scales every stage (width, 2w, 4w, 8w) so CPU runs can use tiny models;
``small_input`` swaps the 7x7/2 conv + max-pool stem for a 3x3/1 conv (CIFAR
style), which keeps 8x8 digits from shrinking to nothing before the first stage.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.init import default_init, init_weights


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    # No bias: every conv is followed by a BatchNorm, whose beta does the job.
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(c_in, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3, 1x1 expand by 4 (ResNet-50 and deeper)."""

    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(c_in, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)  # stride here: "ResNet v1.5", as torchvision
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3


# depth -> (block type, blocks per stage), Table 1 of the paper.
CONFIGS: dict[int, tuple[type[nn.Module], list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
}


class ResNet(nn.Module):
    def __init__(self, depth: int = 18, width: int = 64, num_classes: int = 1000,
                 in_channels: int = 3, small_input: bool = False, zero_init_residual: bool = False):
        super().__init__()
        if depth not in CONFIGS:
            raise ValueError(f"ResNet depth must be one of {sorted(CONFIGS)}, got {depth}")
        if width < 1:
            raise ValueError(f"ResNet width must be >= 1, got {width}")
        block, layers = CONFIGS[depth]
        self.depth, self.width, self.small_input = depth, width, small_input

        if small_input:
            # 3x3/1 and no pool: an 8x8 input stays 8x8 into stage 1 (then 8, 4, 2, 1).
            self.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            # The paper's stem: 7x7/2 conv then 3x3/2 max-pool, 224 -> 56.
            self.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)

        self.c_in = width
        self.layer1 = self._make_stage(block, width, layers[0], stride=1)
        self.layer2 = self._make_stage(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_stage(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_stage(block, width * 8, layers[3], stride=2)
        # Adaptive pooling makes the head independent of the input size (8 px or 224 px).
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)

        self.zero_init_residual = zero_init_residual
        init_weights(self)  # per tensor, seeded by torch.initial_seed() and its name (tandem/models/init.py)

    def init_tensor(self, module: nn.Module, name: str, t: torch.Tensor, g: torch.Generator) -> None:
        """As torchvision: Kaiming-normal (fan_out) convs, BN to identity, the Linear at torch's default."""
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(t, mode="fan_out", nonlinearity="relu", generator=g)
        elif self.zero_init_residual and name.endswith("weight") and _is_last_bn(self, module):
            t.zero_()  # each block then starts as the identity (Goyal et al. 2017), helps large-batch runs
        else:
            default_init(module, name, t, g)

    def _make_stage(self, block: type[nn.Module], planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = None
        c_out = planes * block.expansion
        if stride != 1 or self.c_in != c_out:
            # Projection shortcut (option B of the paper) when the shape changes.
            downsample = nn.Sequential(conv1x1(self.c_in, c_out, stride), nn.BatchNorm2d(c_out))
        stage = [block(self.c_in, planes, stride, downsample)]
        self.c_in = c_out
        stage += [block(self.c_in, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def _is_last_bn(model: ResNet, bn: nn.Module) -> bool:
    return any(isinstance(m, (BasicBlock, Bottleneck)) and m.last_bn() is bn for m in model.modules())


def resnet18(**kw) -> ResNet:
    return ResNet(depth=18, **kw)


def resnet34(**kw) -> ResNet:
    return ResNet(depth=34, **kw)


def resnet50(**kw) -> ResNet:
    return ResNet(depth=50, **kw)
