"""completion_prompts.Echo on outputs as the HTTP door reads them: each choice's first output is
led by its prompt (text, and logprobs with the first token unscored); with the prompt alone
(max_tokens 0) the drawn token is dropped and an ordinary end reads `length`, while an abort, an
error or a deadline keeps its own reason."""
from __future__ import annotations

import pytest

from factories import make_request, make_tokenizer
from scheduler_service.api.completion_prompts import Echo
from scheduler_service.api.openai_logprobs import Unscored
from scheduler_service.core.request import FinishReason, RequestOutput, TokenLogprob, Usage


def _echo(only_prompt: bool, n: int = 1) -> Echo:
    requests = [make_request(prompt_token_ids=[5, 6, 7], n=n), make_request(prompt_token_ids=[9])]
    return Echo(["w5 w6 w7", [9]], requests, make_tokenizer(), only_prompt)


def _usage(completion_tokens: int) -> Usage:
    return Usage(prompt_tokens=3, completion_tokens=completion_tokens, cached_tokens=0,
                 queue_time_us=0, time_to_first_token_us=0)


def test_each_choices_first_output_is_led_by_its_prompt_and_its_logprobs():
    echo = _echo(only_prompt=False, n=2)
    prompt = [TokenLogprob(6, -1.0), TokenLogprob(7, -2.0)]
    first = echo.output(RequestOutput([8], " w8", index=0, logprobs=[TokenLogprob(8, -0.5)],
                                      prompt_logprobs=prompt))
    assert first.text == "w5 w6 w7 w8"
    assert isinstance(first.logprobs[0], Unscored) and first.logprobs[0].token_id == 5
    assert first.logprobs[1:] == [*prompt, TokenLogprob(8, -0.5)]
    fork = echo.output(RequestOutput([3], " w3", index=1, logprobs=[TokenLogprob(3, -0.7)]))
    assert fork.text == "w5 w6 w7 w3" and fork.logprobs[1:3] == prompt  # sample 0's prompt
    later = echo.output(RequestOutput([4], " w4", index=0, logprobs=[TokenLogprob(4, -0.1)]))
    assert later.text == " w4" and later.logprobs == [TokenLogprob(4, -0.1)]
    other_prompt = echo.output(RequestOutput([2], " w2", index=2))  # prompt 1's only sample
    assert other_prompt.text == "w9 w2"


@pytest.mark.parametrize("reason, shown", [
    (FinishReason.EOS, FinishReason.LENGTH), (FinishReason.STOP, FinishReason.LENGTH),
    (FinishReason.LENGTH, FinishReason.LENGTH), (FinishReason.CANCELLED, FinishReason.CANCELLED),
    (FinishReason.ERROR, FinishReason.ERROR), (FinishReason.DEADLINE, FinishReason.DEADLINE),
])
def test_the_prompt_alone_drops_the_drawn_token_and_keeps_an_abnormal_end(reason, shown):
    echo = _echo(only_prompt=True)
    output = echo.output(RequestOutput([1], "<eos>", finish_reason=reason, index=0,
                                       logprobs=[TokenLogprob(1, -0.2)], usage=_usage(1)))
    assert output.text == "w5 w6 w7" and output.token_ids == []
    assert [type(e) for e in output.logprobs] == [Unscored]  # no prompt logprobs were sent
    assert output.finish_reason is shown
    assert output.usage.completion_tokens == 0
