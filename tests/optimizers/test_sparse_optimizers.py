"""`sok.optimizers.Adam` etc. (`sok_keras/optimizers/sparse_optimizers.py`):
Keras optimizers that update tables lazily; they behave exactly like
`OptimizerWrapper` around the Keras class and round-trip through
`model.save`."""

import keras
import numpy as np
import pytest

import sok_keras as sok
from tests.optimizers.test_sparse_rules import initial_values
from tests.optimizers.test_sparse_rules import make_steps
from tests.optimizers.test_sparse_rules import run_sok
from tests.optimizers.test_wrapper import build_model
from tests.optimizers.test_wrapper import check_save_load_continue

CASES = {
    "SGD": dict(learning_rate=0.05, momentum=0.9, nesterov=True),
    "Adagrad": dict(learning_rate=0.05, initial_accumulator_value=0.2),
    "Adam": dict(learning_rate=0.05, beta_1=0.8, amsgrad=True),
    "AdamW": dict(learning_rate=0.05, weight_decay=0.1),
    "Ftrl": dict(learning_rate=0.05, l1_regularization_strength=0.01,
                 l2_shrinkage_regularization_strength=0.01, beta=0.1),
    "RMSprop": dict(learning_rate=0.05, momentum=0.5, centered=True),
    "Adamax": dict(learning_rate=0.05, beta_1=0.8, beta_2=0.99),
    "Adadelta": dict(learning_rate=0.5, rho=0.9),
    "Lion": dict(learning_rate=0.01, beta_1=0.8, beta_2=0.95),
    "Nadam": dict(learning_rate=0.05, beta_1=0.8, beta_2=0.99),
    "Muon": dict(learning_rate=0.05, adam_beta_1=0.8, adam_lr_ratio=0.5),
}


def _np(v):
    return keras.ops.convert_to_numpy(v)


@pytest.mark.parametrize("name", sorted(CASES))
def test_direct_optimizer_equals_wrapper(name):
    kwargs = CASES[name]
    steps = make_steps(seed=31)
    w0, d0 = initial_values(7)
    direct = getattr(sok.optimizers, name)(**kwargs)
    keras_class = getattr(keras.optimizers, name)
    assert isinstance(direct, keras_class) and type(direct) is not keras_class
    table, dense = run_sok(direct, steps, w0, d0)
    keras.utils.clear_session()
    wrapper = sok.OptimizerWrapper(keras_class(**kwargs))
    w_table, w_dense = run_sok(wrapper, steps, w0, d0)
    assert sorted(table.slots) == sorted(w_table.slots)
    assert table.slots  # every case has slots
    np.testing.assert_array_equal(_np(table), _np(w_table))
    for n in table.slots:
        np.testing.assert_array_equal(_np(table.slots[n]),
                                      _np(w_table.slots[n]))
    np.testing.assert_array_equal(_np(dense), _np(w_dense))
    assert int(direct.iterations) == int(wrapper.iterations) == len(steps)
    # Lazy: never-looked-up rows kept their values.
    np.testing.assert_array_equal(_np(table)[-3:], w0[-3:])
    assert not np.array_equal(_np(table), w0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_round_trip_and_registration(name):
    opt = getattr(sok.optimizers, name)(**CASES[name])
    config = opt.get_config()
    for k, v in CASES[name].items():
        assert config[k] == pytest.approx(v)
    clone = type(opt).from_config(config)
    assert clone.get_config() == config
    serialized = keras.optimizers.serialize(opt)
    assert serialized["registered_name"] == f"sok_keras>{name}"
    again = keras.optimizers.deserialize(serialized)
    assert type(again) is type(opt) and again.get_config() == config


def test_model_save_round_trip_continues_identically(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 3, 0.5)
    check_save_load_continue(
        build_model(),
        sok.optimizers.RMSprop(schedule, momentum=0.5, centered=True),
        tmp_path, ["average_gradient", "momentum", "velocity"])


@pytest.mark.parametrize("make,slots", [
    (lambda: sok.optimizers.Lion(0.01), ["momentum"]),
    (lambda: sok.OptimizerWrapper(keras.optimizers.Adamax(0.05)),
     ["momentum", "norm"]),
    (lambda: sok.OptimizerWrapper(keras.optimizers.Adadelta(0.5)),
     ["accumulated_delta_var", "accumulated_grad"]),
    (lambda: sok.OptimizerWrapper(keras.optimizers.Nadam(0.05)),
     ["momentum", "velocity"]),
    (lambda: sok.optimizers.Nadam(0.05), ["momentum", "velocity"]),
    (lambda: sok.OptimizerWrapper(keras.optimizers.Muon(0.05)),
     ["momentum", "velocity"]),
], ids=["Lion", "Adamax", "Adadelta", "Nadam", "sok_Nadam", "Muon"])
def test_newer_rules_save_and_continue_identically(make, slots, tmp_path):
    """Adamax, Adadelta, Lion and Nadam (rules added after the first six):
    their slots (and Nadam's schedule) are saved with the table and the
    optimizer, and a loaded model continues exactly."""
    check_save_load_continue(build_model(), make(), tmp_path, slots)


@pytest.mark.parametrize("kwargs,instead", [
    ({"use_ema": True}, "table-sized average.*Leave use_ema off"),
    ({"loss_scale_factor": 64.0}, "LossScaleOptimizer` instead")],
    ids=["ema", "loss_scale"])
def test_unsupported_base_arguments_fail_at_construction(kwargs, instead):
    """Refused, saying why or what to use instead (QA: `use_ema` said
    neither)."""
    with pytest.raises(ValueError, match=next(iter(kwargs)) + ".*" + instead):
        sok.optimizers.Adam(0.1, **kwargs)
    model = keras.Sequential([
        keras.Input((2,), dtype="int64"),
        sok.layers.DistributedEmbedding(10, 2, combiner="sum")])
    with pytest.raises(ValueError, match=instead):
        model.compile(optimizer=keras.optimizers.Adam(0.1, **kwargs),
                      loss="mse")


def test_weight_decay_is_taken_by_every_rule():
    sok.optimizers.SGD(0.1, weight_decay=0.01)  # decays lazily
    sok.optimizers.Adam(0.1, weight_decay=0.01)
