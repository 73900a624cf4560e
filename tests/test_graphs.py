"""specwhisper.engine.graphs: eager behaviour and misuse errors everywhere; capture == eager on CUDA."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specwhisper.engine.graphs import StepGraphs, graphs_supported


class ToyStep:
    """A decode-step-shaped toy over static buffers: tokens [B] and input_pos [B] in, a row of a
    [B, S, d] cache written at input_pos, (argmax [B], hidden [B, d]) out."""

    def __init__(self, batch: int, device, d: int = 32, vocab: int = 101, slots: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(vocab, d, generator=g).to(device)
        self.w = (torch.randn(d, d, generator=g) / d**0.5).to(device)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.input_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.cache = torch.zeros(batch, slots, d, device=device)
        self.slots = slots

    def __call__(self):
        x = self.embed[self.tokens] @ self.w  # [B, d]
        self.cache.scatter_(1, self.input_pos[:, None, None].expand(-1, 1, x.shape[1]), x[:, None])
        mask = torch.arange(self.slots, device=x.device) <= self.input_pos[:, None]  # [B, S]
        scores = (self.cache @ x[:, :, None]).squeeze(-1).masked_fill(~mask, -float("inf"))  # [B, S]
        hidden = (scores.softmax(-1)[:, :, None] * self.cache).sum(1)  # [B, d]
        return (hidden @ self.embed.T).argmax(-1), hidden

    def write(self, tokens, input_pos):
        self.tokens.copy_(tokens)
        self.input_pos.copy_(input_pos)


def test_graphs_supported_on_cpu():
    assert not graphs_supported("cpu")
    assert not graphs_supported(None)
    assert graphs_supported("cuda") == torch.cuda.is_available()


@pytest.mark.parametrize("enabled", [False, True])
def test_eager_returns_what_fn_returns(enabled):
    graphs = StepGraphs(enabled, device="cpu")
    assert not graphs.capturing
    a, b = ToyStep(3, "cpu"), ToyStep(3, "cpu")
    for step in range(6):
        tokens, pos = torch.tensor([step, 2 * step, 7]), torch.tensor([step, step, min(step, 2)])
        a.write(tokens, pos)
        b.write(tokens, pos)
        got = graphs.run("step", a)
        want = b()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert graphs.keys() == []  # nothing captured on CPU


def test_keys_are_independent():
    graphs = StepGraphs(True, device="cpu")
    one, two = torch.ones(2), torch.full((3,), 2.0)
    assert torch.equal(graphs.run(("draft", 1), lambda: one * 3), torch.full((2,), 3.0))
    assert torch.equal(graphs.run(("verify", 1, 4), lambda: two + 1), torch.full((3,), 3.0))
    assert torch.equal(graphs.run(("draft", 1), lambda: one * 5), torch.full((2,), 5.0))
    out = graphs.run("pair", lambda: (one, two))
    assert isinstance(out, tuple) and out[0] is one and out[1] is two


def test_rehearse_calls_fn_as_often_as_capture_would():
    calls = []
    graphs = StepGraphs(True, device="cpu", warmup=3, rehearse=True)
    graphs.run("a", lambda: calls.append("a") or torch.zeros(1))
    graphs.run("a", lambda: calls.append("a") or torch.zeros(1))
    graphs.run("b", lambda: calls.append("b") or torch.zeros(1))
    assert calls == ["a"] * 5 + ["b"] * 4
    # a step that is not idempotent shows the difference on CPU, as capture would on GPU
    length = torch.zeros((), dtype=torch.long)
    StepGraphs(True, device="cpu", rehearse=True).run("commit", lambda: length.add_(2))
    assert int(length) == 8


def rewinding(state: torch.Tensor):
    """A `rewind` for one state tensor: save it, return its restorer."""
    def rewind():
        saved = state.clone()
        return lambda: state.copy_(saved)
    return rewind


def test_rewind_makes_a_first_use_change_state_once():
    length = torch.zeros((), dtype=torch.long)
    graphs = StepGraphs(True, device="cpu", rehearse=True)
    out = graphs.run("commit", lambda: length.add_(2), rewind=rewinding(length))
    assert int(length) == 2 and int(out) == 2  # 4 calls, 3 of them undone
    graphs.run("commit", lambda: length.add_(2), rewind=rewinding(length))
    assert int(length) == 4


@pytest.mark.parametrize("bad", [None, 3, [], [torch.zeros(1), 2], {"x": torch.zeros(1)}])
def test_non_tensor_outputs_are_refused(bad):
    with pytest.raises(TypeError, match="must return a tensor"):
        StepGraphs(False).run("bad", lambda: bad)


def test_misuse_errors_are_clear():
    graphs = StepGraphs(True, device="cpu")
    with pytest.raises(TypeError, match="hashable"):
        graphs.run(["verify", 1], lambda: torch.zeros(1))
    with pytest.raises(TypeError, match="callable"):
        graphs.run("step", torch.zeros(1))
    with pytest.raises(TypeError, match="bool"):
        StepGraphs("yes")
    with pytest.raises(ValueError, match="warmup"):
        StepGraphs(True, warmup=0)
    with pytest.raises(ValueError, match="duplicate"):
        graphs.capture([("verify", 8), ("verify", 8)], lambda key: (lambda: torch.zeros(1)))
    with pytest.raises(RuntimeError, match="nest"):
        graphs.run("outer", lambda: graphs.run("inner", lambda: torch.zeros(1)))
    graphs.run("after", lambda: torch.zeros(1))  # a failed step leaves the object usable


def test_capture_is_a_no_op_in_eager_mode():
    called = []
    graphs = StepGraphs(True, device="cpu")
    graphs.capture([8, 4, 2, 1], lambda key: called.append(key) or (lambda: torch.zeros(key)))
    assert called == [] and graphs.keys() == []


# ---------------------------------------------------------------------------------------- CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 8])
def test_graphed_toy_step_equals_eager_over_many_replays(batch):
    graphs = StepGraphs(True, device="cuda")
    assert graphs.capturing
    graphed, eager = ToyStep(batch, "cuda", seed=1), ToyStep(batch, "cuda", seed=1)
    g = torch.Generator().manual_seed(0)
    outputs = None
    for step in range(200):
        tokens = torch.randint(0, 101, (batch,), generator=g)
        pos = torch.randint(0, 16, (batch,), generator=g)
        graphed.write(tokens.cuda(), pos.cuda())
        eager.write(tokens.cuda(), pos.cuda())
        got = graphs.run(("toy", batch), graphed)
        if outputs is None:
            outputs = got
        assert got[0] is outputs[0]  # a replay rewrites the same static outputs
        want = eager()
        assert torch.equal(got[0], want[0]), step
        assert torch.equal(got[1], want[1]), step
    assert torch.equal(graphed.cache, eager.cache)
    assert ("toy", batch) in graphs


@pytest.mark.cuda
def test_buckets_share_one_pool_largest_first():
    graphs = StepGraphs(True, device="cuda")
    steps = {b: ToyStep(b, "cuda", seed=b) for b in (8, 4, 1)}
    graphs.capture([8, 4, 1], lambda b: steps[b])
    assert graphs.keys() == [8, 4, 1]
    twins = {b: ToyStep(b, "cuda", seed=b) for b in (8, 4, 1)}
    for step in range(20):
        for b in (1, 8, 4):  # any order of replays
            tokens, pos = torch.arange(b).cuda() + step, torch.full((b,), step % 16).cuda()
            steps[b].write(tokens, pos)
            twins[b].write(tokens, pos)
            got, want = graphs.run(b, steps[b]), twins[b]()
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.cuda
def test_capture_errors_name_the_step_and_the_cause():
    # a failed capture can leave the CUDA context unusable: trigger it in a child process
    code = ("import torch; from specwhisper.engine.graphs import StepGraphs; x = torch.ones(4, device='cuda')\n"
            "try:\n StepGraphs(True, device='cuda').run('sync', lambda: x * float(x.sum().item()))\n"
            "except RuntimeError as e:\n print('CAUGHT', e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    # CUDA's own message spans lines; ours, naming the cause (a sync with the host), follows it
    assert re.search(r"CAUGHT capturing step 'sync'.*host", child.stdout, re.S), child.stdout + child.stderr
    x = torch.ones(4, device="cuda")
    with pytest.raises(ValueError, match="cpu tensor"):
        StepGraphs(True, device="cuda").run("cpu-out", lambda: (x + 1, torch.zeros(1)))


@pytest.mark.cuda
def test_captured_step_with_rewind_changes_state_once_per_call():
    length = torch.zeros(4, dtype=torch.long, device="cuda")
    graphs = StepGraphs(True, device="cuda")
    for call in range(1, 6):
        graphs.run("commit", lambda: length.add_(torch.arange(4, device="cuda")), rewind=rewinding(length))
        assert torch.equal(length.cpu(), call * torch.arange(4)), call
