"""The generation controls' options (README, "Generation controls": each one's range and
exact definition), for the job commands (options.job_options)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from eagle2_core.config import CONTROL_BOUNDS
from producer.control_fields import BadControl, logit_bias_entry, response_format
from producer.storable import json_problem

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


class LogitBias(click.ParamType):
    """--logit-bias ID=BIAS: a token id and the bias added to its logit."""

    name = "ID=BIAS"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, float]:
        if isinstance(value, tuple):
            return value
        token, _, bias = str(value).partition("=")
        try:
            return logit_bias_entry(token.strip(), float(bias))
        except BadControl as exc:
            self.fail(f"{value!r}: expected {exc.expected}", param, ctx)
        except ValueError:
            self.fail(f"{value!r} is not ID=BIAS (a token id, '=', a number)", param, ctx)


class ResponseFormat(click.ParamType):
    """--response-format JSON: a response_format object, checked as a line's is."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        try:
            parsed = json.loads(value)
        except ValueError as exc:
            self.fail(f"not JSON: {exc}", param, ctx)
        problem = json_problem(parsed, "--response-format")
        if problem is not None:
            self.fail(problem, param, ctx)
        try:
            return response_format(parsed)
        except BadControl as exc:
            self.fail(
                f"{exc.where.lstrip('.') or 'the object'}: expected {exc.expected}", param, ctx
            )


def _control_type(key: str) -> click.ParamType:
    bound = CONTROL_BOUNDS[key]
    if bound.integer:
        return click.IntRange(int(bound.low), None if bound.high is None else int(bound.high))
    return click.FloatRange(bound.low, bound.high, min_open=bound.low_open)


def control_options() -> list[Decorator]:
    """The job's generation controls (README, "Generation controls"); a line's own override
    them. Unset, a control is not stored with the job."""

    def option(name: str, key: str, help: str) -> Decorator:
        return click.option(name, key, type=_control_type(key), default=None, help=help)

    return [
        option(
            "--top-k",
            "top_k",
            "Sample from the K most likely tokens only (0: all; transformers' and vLLM's "
            "top_k). The draft tree's width is --tree-width.",
        ),
        option(
            "--min-p",
            "min_p",
            "Sample only tokens at least P times as likely as the most likely one (vLLM's and "
            "transformers' min_p).",
        ),
        option(
            "--repetition-penalty",
            "repetition_penalty",
            "Divide a positive logit (multiply a negative one) of every token already in the "
            "prompt or the answer by this (transformers' and vLLM's repetition_penalty).",
        ),
        option(
            "--presence-penalty",
            "presence_penalty",
            "Subtract this from the logit of every token the answer holds (OpenAI's).",
        ),
        option(
            "--frequency-penalty",
            "frequency_penalty",
            "Subtract this times its count in the answer from each token's logit (OpenAI's).",
        ),
        click.option(
            "--logit-bias",
            type=LogitBias(),
            multiple=True,
            help="Add BIAS (-100 to 100) to token ID's logit (OpenAI's logit_bias); repeat "
            "for more tokens.",
        ),
        click.option(
            "--stop-token-id",
            "stop_token_ids",
            type=click.IntRange(0),
            multiple=True,
            help="End the answer at this token (finish_reason stop; kept in the token ids, "
            "not in the text: vLLM's stop_token_ids); repeatable.",
        ),
        option(
            "--min-tokens",
            "min_tokens",
            "Hold back the end tokens (the model's and --stop-token-id) until the answer has "
            "this many tokens (vLLM's min_tokens, transformers' min_new_tokens).",
        ),
        click.option(
            "--logprobs",
            type=_control_type("top_logprobs"),
            default=None,
            metavar="K",
            help="Store every answer token's logprob and the K (0-20) most likely tokens of "
            "its position: the target's raw distribution (OpenAI's logprobs + top_logprobs).",
        ),
        click.option(
            "--response-format",
            type=ResponseFormat(),
            default=None,
            help='Constrain every answer (OpenAI\'s response_format): {"type": "json_object"}, '
            '{"type": "json_schema", "json_schema": {"schema": {...}}}, or as vLLM and SGLang '
            'guide decoding {"type": "regex", "regex": "..."} or {"type": "grammar", '
            '"grammar": "..."} (Lark or GBNF). Greedy output is the same in every mode; a '
            'line\'s own response_format wins ({"type": "text"}: free).',
        ),
    ]
