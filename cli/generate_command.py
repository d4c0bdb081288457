"""`kiln generate`: run the runtime in-process on a prompt and stream the text."""

from __future__ import annotations

import argparse
import json
import sys

from kiln.runtime.diffusion.params import CACHE_MODES, CONFIDENCE, REMASKING

# The diffusion flags, by their DiffusionParams field.
DIFFUSION_FLAGS = ("steps", "block_length", "remasking", "confidence", "threshold", "cache", "cfg_scale")

from .model_args import add_model_arguments, device_name, resolve_artifacts


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--seed", type=int)
    group.add_argument("--n", type=int, default=1)
    group.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int, help="print the chosen token's logprob and this many alternatives")
    diffusion = parser.add_argument_group("diffusion LMs (LLaDA, Dream): see docs/diffusion.md")
    diffusion.add_argument("--steps", type=int, help="passes of the fixed schedule (default: one token per pass)")
    diffusion.add_argument("--block-length", type=int, help="semi-autoregressive block (default: 32)")
    diffusion.add_argument("--remasking", choices=REMASKING)
    diffusion.add_argument("--confidence", choices=CONFIDENCE)
    diffusion.add_argument("--threshold", type=float, help="Fast-dLLM parallel decoding: commit every position this sure")
    diffusion.add_argument("--cache", choices=CACHE_MODES, help="none, prefix or dual (Fast-dLLM's K/V caches)")
    diffusion.add_argument("--cfg-scale", type=float, help="classifier-free guidance (with --cache none)")


def sampling_from_args(args):
    from kiln.runtime.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, n=args.n, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, diffusion=diffusion_from_args(args),
    )


def diffusion_from_args(args):
    """DiffusionParams from the diffusion flags given, or None (an autoregressive model refuses them)."""
    from kiln.runtime.diffusion.params import DiffusionParams

    given = {name: getattr(args, name) for name in DIFFUSION_FLAGS if getattr(args, name) is not None}
    return DiffusionParams(**given) if given else None


def run_generate(args) -> int:
    from kiln.runtime.offline import LLM

    params = sampling_from_args(args)
    artifacts = resolve_artifacts(args)
    with LLM(artifacts, device=device_name(args), parameter_memory=args.parameter_memory) as llm:
        if args.chat:
            prompt = llm.service.encode(render_chat(llm.service, args.prompt), add_special_tokens=False)
        else:
            prompt = args.prompt
        if params.n == 1 and not args.json:
            for event in llm.stream(prompt, params, add_special_tokens=not args.no_special_tokens):
                if event.error:
                    raise RuntimeError(event.error)
                sys.stdout.write(event.text)
                sys.stdout.flush()
                if event.finish_reason:
                    print(f"\n[finish: {event.finish_reason}]", file=sys.stderr)
            sys.stdout.write("\n")
            return 0
        [result] = llm.generate([prompt], params, add_special_tokens=not args.no_special_tokens)
        if args.json:
            print(json.dumps({
                "prompt_token_ids": result.prompt_token_ids,
                "completions": [
                    {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                     "logprobs": [{"token_id": lp.token_id, "logprob": lp.logprob,
                                   "top": {str(k): v for k, v in lp.top.items()}} for lp in c.logprobs]}
                    for c in result.completions
                ],
            }))
        else:
            for index, completion in enumerate(result.completions):
                print(f"--- completion {index} ({completion.finish_reason})\n{completion.text}")
    return 0


def render_chat(service, user_text: str) -> str:
    from kiln.runtime.chat import render_chat_template

    return render_chat_template(service.tokenizer_config, [{"role": "user", "content": user_text}])


def add_command(commands) -> None:
    parser = commands.add_parser("generate", help="generate text in-process (no server)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--no-special-tokens", action="store_true", help="do not add BOS")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.set_defaults(run=run_generate)
