"""Per-request layer states: RequestStates keeps what transformers' linear-attention cache layer keeps, and a
`@per_request` layer run on a packed step of several requests gives what each request gives alone."""

import pytest
import torch
from transformers.cache_utils import LinearAttentionLayer

from runtime.engine.forward_metadata import ForwardMetaData
from runtime.errors import UserError
from runtime.layers.request_states import RequestStates, StateStore, per_request


@pytest.mark.parametrize("lengths", [(5, 1, 1, 3), (2, 1, 1), (4, 1)])
def test_conv_and_recurrent_states_follow_transformers_cache_layer(lengths):
    torch.manual_seed(0)
    ours, theirs = RequestStates(), LinearAttentionLayer()
    for length in lengths:
        x = torch.randn(1, 6, length)
        if ours.get_conv_state(0) is not None:
            torch.testing.assert_close(ours.get_conv_state(0), theirs.conv_states[0], rtol=0, atol=0)
        full = ours.update_conv_state(x, 0, conv_kernel_size=4)
        torch.testing.assert_close(full, theirs.update_conv_state(x, conv_kernel_size=4), rtol=0, atol=0)
        state = torch.randn(1, 2, 3, 3)
        torch.testing.assert_close(
            ours.update_recurrent_state(state, 0), theirs.update_recurrent_state(state)
        )
    assert not ours.is_recording_past(0)


class RunningSum(torch.nn.Module):
    """A toy recurrent layer written as HF writes them: state through the cache API, [1, L, D] in and out."""

    @per_request(states="states")
    def forward(
        self, x: torch.Tensor, scale: tuple[torch.Tensor, float], states: RequestStates | None = None
    ):
        previous = states.get_recurrent_state(0)
        total = x.cumsum(1) + (0 if previous is None else previous)
        states.update_recurrent_state(total[:, -1:], 0)
        return total * scale[0] * scale[1]


def _metadata(lengths: list[int], states: list[RequestStates], is_prefill: bool) -> ForwardMetaData:
    q = torch.tensor(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ForwardMetaData(
        is_prefill=is_prefill,
        kv_len=torch.zeros_like(q),
        actual_seq_lengths_q=q,
        actual_seq_lengths_kv=q,
        actual_seq_lengths_cu_q=cu,
        positions=torch.zeros(int(q.sum()), dtype=torch.long),
        max_seq_len_q=max(lengths),
        max_seq_len_kv=max(lengths),
        request_states=states,
    )


def test_a_packed_step_gives_what_each_request_gives_alone():
    torch.manual_seed(0)
    layer, store = RunningSum(), StateStore()
    prompts = [torch.randn(1, n, 4) for n in (3, 1, 2)]
    decodes = [torch.randn(1, 1, 4) for _ in prompts]
    weight = torch.randn(1, 6, 4)  # a per-token input beside the hidden states, split alike

    def packed(xs, is_prefill):
        lengths = [x.shape[1] for x in xs]
        md = _metadata(lengths, store.for_step(list(range(len(xs))), is_prefill, len(xs)), is_prefill)
        w = weight[:, : sum(lengths)]
        return layer(torch.cat(xs, 1), (w, 2.0), forward_metadata=md)

    out = packed(prompts, True)
    step = packed(decodes, False)
    for i, (prompt, decode) in enumerate(zip(prompts, decodes)):
        start = sum(p.shape[1] for p in prompts[:i])
        alone = _metadata([prompt.shape[1]], [RequestStates()], True)
        w = weight[:, start : start + prompt.shape[1]]
        torch.testing.assert_close(
            out[:, start : start + prompt.shape[1]], layer(prompt, (w, 2.0), forward_metadata=alone)
        )
        next_alone = _metadata([1], alone.request_states, False)
        torch.testing.assert_close(
            step[:, i : i + 1], layer(decode, (weight[:, i : i + 1], 2.0), forward_metadata=next_alone)
        )


class ShortConv(torch.nn.Module):
    """A toy short convolution written as HF writes them: the window through the cache API, and in decode updated
    in place in the tensor `get_conv_state` returns, as `causal_conv1d_update` does."""

    calls = 0

    @per_request(states="states")
    def forward(self, x: torch.Tensor, states: RequestStates | None = None):
        self.calls += 1
        window = states.get_conv_state(0)
        if window is None or x.shape[1] > 1:
            window = states.update_conv_state(x.transpose(1, 2), 0, conv_kernel_size=3)
            return window.cumsum(-1)[..., -x.shape[1] :].transpose(1, 2)
        window.copy_(window.roll(-1, -1))
        window[..., -1] = x[:, 0]
        return window.sum(-1, keepdim=True).transpose(1, 2)


def test_a_decode_step_runs_once_on_the_stacked_states_and_hands_each_request_its_row():
    torch.manual_seed(0)
    layer, store = ShortConv(), StateStore()
    prompts = [torch.randn(1, n, 2) for n in (3, 1, 4)]
    md = _metadata([3, 1, 4], store.for_step([0, 1, 2], True, 3), True)
    layer(torch.cat(prompts, 1), forward_metadata=md)
    alone = [_metadata([p.shape[1]], [RequestStates()], True) for p in prompts]
    for p, a in zip(prompts, alone):
        layer(p, forward_metadata=a)
    for _ in range(2):  # two decode steps, each request's window moved on in place
        tokens = [torch.randn(1, 1, 2) for _ in prompts]
        rows = store.for_step([0, 1, 2], False, 4)  # a fourth row padded past the batch, with no states
        calls = layer.calls
        step = layer(torch.cat([*tokens, tokens[0]], 1), forward_metadata=_metadata([1] * 4, rows, False))
        assert layer.calls == calls + 1  # once for the four rows
        for i, (t, a) in enumerate(zip(tokens, alone)):
            one = layer(t, forward_metadata=_metadata([1], a.request_states, False))
            torch.testing.assert_close(step[:, i : i + 1], one)
            torch.testing.assert_close(rows[i].get_conv_state(0), a.request_states[0].get_conv_state(0))
        assert rows[3].get_conv_state(0) is not None  # the padded row read zeros and kept its own
    elsewhere = store.for_step([0, 9], False, 2)  # request 9 was prefilled by another engine
    with pytest.raises(UserError, match="without prefill-decode disaggregation"):
        layer(torch.randn(1, 2, 2), forward_metadata=_metadata([1, 1], elsewhere, False))


def test_states_start_afresh_at_prefill_and_go_at_release():
    store = StateStore()
    first = store.for_step([7, 8], is_prefill=True, rows=3)
    assert len(first) == 3 and len(store) == 2  # the padded row's states are nobody's
    assert store.for_step([8], is_prefill=False, rows=1)[0] is first[1]
    again = store.for_step([8], is_prefill=True, rows=1)[0]  # a preempted request recomputes from its prompt
    assert again is not first[1]
    store.release(7)
    store.release(8)
    assert len(store) == 0
    elsewhere = store.for_step([9], is_prefill=False, rows=1)[0]  # prefilled by another engine
    with pytest.raises(UserError, match="without prefill-decode disaggregation"):
        elsewhere.get_conv_state(0)


def test_a_request_s_states_are_handed_over_and_go_on_elsewhere():
    # prefill-decode disaggregation: the prefill engine takes a finished request's states, the decode engine
    # adopts them under its own request id and decodes from them as the prefill engine would have
    torch.manual_seed(0)
    layer, prefill, decode = ShortConv(), StateStore(), StateStore()
    prompt, token = torch.randn(1, 3, 2), torch.randn(1, 1, 2)
    layer(prompt, forward_metadata=_metadata([3], prefill.for_step([1], True, 1), True))
    kept = prefill.for_step([1], False, 1)[0].get_conv_state(0).clone()
    sent = prefill.take(1)
    assert prefill.take(1) is None and len(prefill) == 0
    decode.adopt(7, sent, torch.device("cpu"))
    got = layer(token, forward_metadata=_metadata([1], decode.for_step([7], False, 1), False))
    alone = RequestStates()
    alone.conv[(0, 0)], alone.conv_width[(0, 0)] = kept, 3
    torch.testing.assert_close(got, layer(token, forward_metadata=_metadata([1], [alone], False)))


def test_states_go_where_the_caller_left_them_and_a_caller_passing_its_own_is_told_to_stop():
    md = _metadata([1], [RequestStates()], True)
    x, scale = torch.ones(1, 1, 2), (torch.ones(1, 1, 2), 1.0)
    torch.testing.assert_close(RunningSum()(x, scale, None, forward_metadata=md), x)  # ZAYA passes None there
    with pytest.raises(UserError, match="given `states`"):
        RunningSum()(
            torch.ones(1, 1, 2), (torch.ones(1, 1, 2), 1.0), states=RequestStates(), forward_metadata=md
        )


def test_a_layer_given_only_part_of_the_step_s_tokens_is_refused():
    md = _metadata([2, 2], [RequestStates(), RequestStates()], True)
    with pytest.raises(UserError, match="token layout split across ranks"):
        RunningSum()(torch.ones(1, 2, 2), (torch.ones(1, 2, 2), 1.0), forward_metadata=md)


def test_a_forward_taking_the_step_s_metadata_is_refused_when_decorated():
    with pytest.raises(UserError, match="leave the parameter out"):

        @per_request(states="states")
        def forward(self, x, states=None, *, forward_metadata):
            return x
