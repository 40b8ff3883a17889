"""benchmarks/server_cost_model.py: the step's seconds in each mode are its terms composed as
docs/engines.md ("What server mode costs") says, checked against a hand computation of the
default recipe on 4 + 4 GPUs; in-flight updates are never slower than one step ahead, which is
never slower than synchronous; the measured inputs come from bench_servers.py's JSON; bad
layouts are refused by name."""

import json
import os
import sys

import pytest

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import server_cost_model as model  # noqa: E402


def test_the_terms_and_their_composition_by_hand():
    recipe, hardware = model.Recipe(), model.Hardware()
    # 512 sequences: a batch rollout on 4 GPUs runs 1,024 decode steps of 4 ms plus 51,200 tokens
    # x 20 us a GPU; in flight, 128 sequences a GPU share each step's 4 ms
    assert model.generation_seconds(recipe, hardware, 4) == pytest.approx(1024 * 4e-3 + 51200 * 20e-6)
    assert model.generation_seconds(recipe, hardware, 4, in_flight=True) == pytest.approx(51200 * (4e-3 / 128 + 20e-6))
    # 10 FLOPs a parameter a token (6, 2 for the recompute, 2 for the reference) x 512 x 656 tokens
    train = 10 * 1.54e9 * 512 * 656 / (4 * 989e12 * 0.4)
    assert model.training_seconds(recipe, hardware, 4) == pytest.approx(train)
    push = 0.05 + 3.09e9 / 150e9
    gen, gen_in_flight = 1024 * 4e-3 + 51200 * 20e-6, 51200 * (4e-3 / 128 + 20e-6)
    expected = dict(
        server_sync=gen + push + train,
        server_async=max(gen + push, train),
        in_flight=max(gen_in_flight + 0.01, train, push),
        colocated=1024 * 4e-3 + 25600 * 20e-6 + train / 2 + 3.09e9 / 1e12,
    )
    for mode, seconds in expected.items():
        assert model.step_seconds(recipe, hardware, 4, 4, mode) == pytest.approx(seconds), mode
    # across nodes the push takes the network's rate; a given rate (the TCP backend's) wins
    assert model.push_seconds(recipe, hardware, 2) == pytest.approx(0.05 + 3.09e9 / 40e9)
    assert model.push_seconds(recipe, hardware, 2, bytes_per_s=1e9) == pytest.approx(0.05 + 3.09)


def test_in_flight_is_never_slower_than_one_step_ahead_nor_that_than_synchronous():
    for recipe in (model.Recipe(), model.Recipe(mean_completion=900, max_completion=1024), model.Recipe(prompts=8)):
        for train_gpus, gen_gpus, nodes in ((1, 1, 1), (4, 4, 1), (6, 2, 1), (12, 4, 2)):
            seconds = [
                model.step_seconds(recipe, model.Hardware(), train_gpus, gen_gpus, mode, nodes)
                for mode in ("in_flight", "server_async", "server_sync")
            ]
            assert seconds == sorted(seconds), (recipe, train_gpus, gen_gpus, seconds)


def test_measured_inputs_come_from_the_benchmarks_json(tmp_path):
    path = tmp_path / "s.json"
    models = [
        dict(model="tiny", weight_bytes=4e5, push_s=0.05, round_trip_s=0.02),
        dict(model="smollm2", weight_bytes=5e8, push_s=0.55),
        dict(model="smollm2-360m-shape", weight_bytes=1.5e9, push_s=1.55),
    ]
    path.write_text(json.dumps(dict(models=models)))
    measured = model.measured_inputs(str(path))
    assert measured == dict(push_fixed_s=0.05, round_trip_s=0.02, tcp_bytes_per_s=pytest.approx(1e9))
    assert model.measured_inputs(str(tmp_path / "none.json")) == {}


@pytest.mark.parametrize(
    "args, message",
    [(dict(mode="fast"), "mode must be one of"), (dict(gen_gpus=0), "train_gpus, gen_gpus and nodes must be >= 1")],
)
def test_bad_layouts_are_refused_by_name(args, message):
    call = {**dict(train_gpus=4, gen_gpus=4, mode="in_flight"), **args}
    with pytest.raises(ValueError, match=message):
        model.step_seconds(model.Recipe(), model.Hardware(), **call)
