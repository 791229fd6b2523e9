"""ResNet topology (parameter counts of the paper), shapes, and build_model's errors."""

import pytest
import torch
from torch import nn

from tandem.core.errors import ConfigError
from tandem.core.spec import ModelSpec
from tandem.models import build_model, count_params, model_signature
from tandem.models.resnet import Bottleneck, ResNet


@pytest.mark.parametrize("depth,expected", [(18, 11_689_512), (34, 21_797_672), (50, 25_557_032)])
def test_param_counts_match_paper(depth, expected):
    # torchvision's counts for 1000 classes at width 64.
    assert count_params(ResNet(depth=depth, width=64, num_classes=1000)) == expected


def test_resnet50_is_bottleneck_with_2048_features():
    m = ResNet(depth=50, width=64)
    assert isinstance(m.layer1[0], Bottleneck)
    assert m.fc.in_features == 2048
    assert [len(s) for s in (m.layer1, m.layer2, m.layer3, m.layer4)] == [3, 4, 6, 3]


@pytest.mark.parametrize("depth", [18, 34, 50])
def test_forward_8x8_small_input(depth):
    m = ResNet(depth=depth, width=8, num_classes=10, in_channels=1, small_input=True)
    assert isinstance(m.maxpool, nn.Identity) and m.conv1.kernel_size == (3, 3)
    out = m(torch.randn(4, 1, 8, 8))
    assert out.shape == (4, 10) and torch.isfinite(out).all()


def test_forward_64x64_paper_stem():
    m = ResNet(depth=18, width=8, num_classes=5, in_channels=3, small_input=False)
    assert m.conv1.kernel_size == (7, 7) and m.conv1.stride == (2, 2)
    assert isinstance(m.maxpool, nn.MaxPool2d)
    assert m(torch.randn(2, 3, 64, 64)).shape == (2, 5)


def test_backward_reaches_the_stem():
    m = ResNet(depth=18, width=4, num_classes=3, in_channels=1, small_input=True)
    m(torch.randn(3, 1, 8, 8)).sum().backward()
    assert m.conv1.weight.grad is not None and m.conv1.weight.grad.abs().sum() > 0


def test_zero_init_residual_zeroes_last_bn():
    m = ResNet(depth=50, width=4, zero_init_residual=True)
    assert torch.count_nonzero(m.layer1[0].bn3.weight) == 0
    assert torch.count_nonzero(m.layer1[0].bn1.weight) > 0


def test_bad_depth_rejected():
    with pytest.raises(ValueError):
        ResNet(depth=101)


def test_build_model_builtin_uses_spec():
    m = build_model(ModelSpec(name="resnet34", width=4, num_classes=7, in_channels=2, small_input=True))
    assert isinstance(m, ResNet) and m.depth == 34
    assert m.conv1.in_channels == 2 and m.fc.out_features == 7 and m.conv1.out_channels == 4


def test_build_model_unknown_name():
    with pytest.raises(ConfigError) as e:
        build_model(ModelSpec(name="resnet999"))
    assert e.value.field == "model.name" and e.value.value == "resnet999"
    assert "resnet18" in str(e.value) and "resnet50" in str(e.value)


@pytest.mark.parametrize("name", ["no_such_module_xyz:make", "tandem.models:no_such_factory", ":make"])
def test_build_model_failing_import(name):
    with pytest.raises(ConfigError) as e:
        build_model(ModelSpec(name=name))
    assert e.value.field == "model.name" and e.value.value == name and e.value.fix


def make_tiny(num_classes, in_channels):
    return nn.Sequential(nn.Conv2d(in_channels, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, num_classes))


def make_not_a_module(num_classes, in_channels):
    return "nope"


def make_without_kwargs():
    return nn.Linear(2, 2)


def test_build_model_import_path_factory():
    m = build_model(ModelSpec(name=f"{__name__}:make_tiny", num_classes=6, in_channels=2))
    assert m[0].in_channels == 2 and m[-1].out_features == 6
    assert m(torch.randn(1, 2, 8, 8)).shape == (1, 6)


@pytest.mark.parametrize("factory", ["make_not_a_module", "make_without_kwargs"])
def test_build_model_bad_factory(factory):
    with pytest.raises(ConfigError) as e:
        build_model(ModelSpec(name=f"{__name__}:{factory}"))
    assert e.value.field == "model.name"


def test_signature_differs_between_widths_and_matches_itself():
    a = model_signature(ResNet(depth=18, width=8))
    b = model_signature(ResNet(depth=18, width=16))
    assert a == model_signature(ResNet(depth=18, width=8))
    assert a != b and a.keys() == b.keys()
    assert a["conv1.weight"] == [8, 3, 7, 7]
    # Buffers count too: BN running stats are part of a checkpoint.
    assert "bn1.running_mean" in a and all(isinstance(v, list) for v in a.values())
