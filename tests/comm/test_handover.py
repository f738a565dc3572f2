"""The pickle-free description of a training state that a live peer hands to the others."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep.comm.handover import decode_state, encode_state

pytestmark = pytest.mark.timeout(120)


def test_an_optimizer_state_survives_the_round_trip_with_int_keys_and_tuples() -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "position": {"epoch": 1, "cursor": 48}}
    tensors: list[torch.Tensor] = []
    text = json.dumps(encode_state(state, tensors))  # what travels: JSON and raw tensors
    back = decode_state(json.loads(text), [t.clone() for t in tensors])
    assert back["position"] == {"epoch": 1, "cursor": 48}
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.9)
    assert sorted(back["optimizer"]["state"]) == [0, 1]
    fresh = torch.optim.Adam(torch.nn.Linear(3, 2).parameters(), lr=0.5)
    fresh.load_state_dict(back["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    for key, value in model.state_dict().items():
        assert torch.equal(back["model"][key], value)


def test_an_object_that_is_not_plain_data_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot hand over a object"):
        encode_state({"x": object()}, [])
