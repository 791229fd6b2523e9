"""The model factory's contract: called with the [model] fields its signature names and the section's
keys tandem does not know (model.extra), checked against the signature before anything starts; a
TypeError inside the factory's body is reported as that, at the factory's own line."""

from __future__ import annotations

import pytest
from torch import nn

from tandem.core.config import apply_overrides, from_dict, load_spec, to_dict
from tandem.core.errors import ConfigError
from tandem.core.spec import ModelSpec
from tandem.models import build_model, factory_kwargs

HERE = __name__
SEEN: dict = {}


def mlp(num_classes, in_channels, width=8, depth=1, dropout=0.0):
    SEEN.update(num_classes=num_classes, in_channels=in_channels, width=width, depth=depth, dropout=dropout)
    layers = [nn.Linear(in_channels, width), nn.ReLU(), nn.Dropout(dropout)]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def body_type_error(num_classes, in_channels):
    return nn.Linear(in_channels, num_classes, nonsense=True)  # the TypeError is this line's


def open_kwargs(num_classes, **kw):
    SEEN.update(kw, num_classes=num_classes)
    return nn.Linear(3, num_classes)


def needs_hidden_size(num_classes, hidden_size):
    return nn.Linear(hidden_size, num_classes)


def _spec(**model) -> ModelSpec:
    return from_dict({"model": {"name": f"{HERE}:mlp", **model}}).model


def test_extra_keys_reach_the_factory():
    spec = _spec(num_classes=3, in_channels=5, width=16, depth=3, dropout=0.25)
    assert spec.extra == {"depth": 3, "dropout": 0.25}       # width is a known field the factory names
    m = build_model(spec)
    assert SEEN == {"num_classes": 3, "in_channels": 5, "width": 16, "depth": 3, "dropout": 0.25}
    assert sum(isinstance(x, nn.Linear) for x in m) == 4
    assert factory_kwargs(spec) == SEEN


def test_extra_keys_survive_spec_json_and_overrides():
    data = apply_overrides({"model": {"name": f"{HERE}:mlp", "depth": 2}}, {"model.dropout": "0.5",
                                                                            "model.depth": "4"})
    spec = from_dict(data)
    assert spec.model.extra == {"depth": 4, "dropout": 0.5}  # command-line values parsed as TOML values
    again = from_dict(to_dict(spec))                           # spec.json round trip
    assert again.model.extra == {"depth": 4, "dropout": 0.5}


def test_a_typo_gets_did_you_mean_before_the_factory_runs():
    SEEN.clear()
    with pytest.raises(ConfigError) as e:
        build_model(_spec(depht=3))
    assert e.value.field == "model.depht" and "did you mean 'model.depth'?" in str(e.value)
    assert "takes no keyword 'depht'" in str(e.value) and not SEEN


def test_a_key_the_factory_does_not_take():
    with pytest.raises(ConfigError) as e:
        build_model(_spec(activation="gelu"))
    assert e.value.field == "model.activation" and "takes no keyword 'activation'" in str(e.value)
    assert "num_classes, in_channels, width, depth, dropout" in str(e.value)


def test_a_parameter_nothing_gives_is_named():
    with pytest.raises(ConfigError) as e:
        build_model(ModelSpec(name=f"{HERE}:needs_hidden_size"))
    assert e.value.field == "model.hidden_size" and "needs hidden_size=" in str(e.value)
    m = build_model(from_dict({"model": {"name": f"{HERE}:needs_hidden_size", "hidden_size": 7}}).model)
    assert m.in_features == 7


def test_var_kwargs_factory_gets_the_classifier_fields_and_extra():
    SEEN.clear()
    build_model(_spec(name=f"{HERE}:open_kwargs", num_classes=4, anything=1))
    assert SEEN == {"num_classes": 4, "in_channels": 3, "anything": 1}


def test_a_type_error_inside_the_body_is_reported_as_itself():
    with pytest.raises(ConfigError) as e:
        build_model(ModelSpec(name=f"{HERE}:body_type_error"))
    text = str(e.value)
    assert "raised TypeError" in text and "nonsense" in text and "accept num_classes" not in text
    assert "test_factory_kwargs.py:" in text
    line = int(text.split("test_factory_kwargs.py:")[1].split(")")[0])
    assert "nonsense=True" in open(__file__).read().splitlines()[line - 1]


def test_builtin_models_still_refuse_unknown_keys():
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"name": "resnet18", "depth": 3}})
    assert e.value.field == "model.depth" and e.value.message == "unknown key"
    with pytest.raises(ConfigError) as e:
        load_spec(None, ["--model.dpth", "3"], check=False)
    assert e.value.field == "model.dpth"
    with pytest.raises(ConfigError) as e:
        from_dict({"model": {"name": "resnet18", "widht": 3}})
    assert "did you mean 'model.width'?" in str(e.value)
