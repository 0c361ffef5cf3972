"""Command line: `dspark generate` streams an answer with speed and acceptance figures."""
from __future__ import annotations

import argparse
import sys
import time

from .cli_args import add_engine_args, check_args, llm_from_args, options_from_args


def add_sampling_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy; higher samples more freely (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off (default: %(default)s)")
    g.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default: %(default)s)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def skipped_note(stats) -> str:
    """How often the scheduler skipped the drafter, when it did."""
    skipped = sum(st.draft_skipped for st in stats)
    return f", drafter skipped on {skipped}/{len(stats)} steps (it did not pay here)" if skipped else ""


def cmd_generate(args) -> int:
    from . import SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = llm_from_args(args, max_num_seqs=1)  # one request: a cost table profiled at first use needs B <= γ + 1
    if args.raw:
        inputs = prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
        inputs = llm.chat_prompt(messages)

    def stream(out):
        sys.stdout.write(out.delta)
        sys.stdout.flush()

    start = time.perf_counter()
    out = llm.generate(inputs, params, on_output=stream)[0]
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if out.finish_reason == "error":
        print(f"error: {out.error}", file=sys.stderr)
        return 1
    if not args.quiet:
        n = len(out.token_ids)
        rate = out.drafts_accepted / out.drafts_verified if out.drafts_verified else 0.0
        drafter = type(llm.engine.drafter).__name__
        print(f"[{n} tokens in {elapsed:.2f} s: {n / elapsed:.1f} tok/s | {drafter}: "
              f"acceptance length τ {out.acceptance_length:.2f}, {out.drafts_accepted}/{out.drafts_verified} "
              f"drafts accepted ({rate:.0%}){skipped_note(llm.engine.stats)} | finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .serve.app import serve
    from .serve.settings import ServerSettings

    settings = ServerSettings(args.model_name, args.api_key, args.max_waiting, args.default_max_tokens,
                              args.max_completion_tokens, args.max_prompt_tokens, args.max_n, args.max_body_bytes,
                              args.online_calibration)
    llm = llm_from_args(args, max_num_seqs=args.max_num_seqs, profile=args.profile)
    return serve(llm, settings, args.host, args.port, args.graceful_seconds)


def add_serve_parser(sub):
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and completions, streaming)",
                        description="Serve the target (with the drafter and scheduler) behind an OpenAI-compatible "
                                    "API: POST /v1/chat/completions and /v1/completions (stream or not; logprobs; "
                                    "top_k as an extension), GET /v1/models, /health and /metrics (Prometheus), and a "
                                    "live page of the engine's steps at / (open it in a browser). All "
                                    "connections share one engine loop, so concurrent requests are batched together. "
                                    "The port opens at once: without a cached SPS(B) profile the cost-table schedulers "
                                    "start from a provisional table that measured steps correct (--profile measures "
                                    "one first). SIGINT or SIGTERM stops accepting, lets running requests finish "
                                    "(--graceful-seconds), cancels the rest and exits 0.")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine "
                    "only; 0.0.0.0 for every interface)")
    sv.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    sv.add_argument("--model-name", default="dspark", help="the model id clients send (default: %(default)s)")
    sv.add_argument("--api-key", default=None,
                    help="require 'Authorization: Bearer KEY' on every route but /health (default: none required)")
    sv.add_argument("--max-num-seqs", type=int, default=64,
                    help="requests decoding at once, the batch limit (default: %(default)s)")
    sv.add_argument("--max-waiting", type=int, default=256,
                    help="requests queued beyond the running ones; more get 429 (default: %(default)s)")
    sv.add_argument("--default-max-tokens", type=int, default=256,
                    help="max_tokens when a request gives none (capped by the context) (default: %(default)s)")
    sv.add_argument("--max-completion-tokens", type=int, default=None,
                    help="the largest max_tokens a request may ask for (default: the context's room)")
    sv.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="the longest prompt in tokens; longer ones get 400 (default: the context less one)")
    sv.add_argument("--max-n", type=int, default=16, help="choices per request at most (default: %(default)s)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20,
                    help="request body size at most; larger ones get 413 (default: %(default)s)")
    sv.add_argument("--online-calibration", action="store_true",
                    help="re-fit the confidence head's STS temperatures on live traffic when its calibration drifts "
                         "(checked either way; shown on the page at / and in /metrics). Outputs never change, only "
                         "which drafts are verified (default: off)")
    sv.add_argument("--profile", action="store_true",
                    help="with no cached SPS(B) profile, measure one before opening the port (minutes)")
    sv.add_argument("--graceful-seconds", type=float, default=30.0,
                    help="on shutdown, how long running requests may finish (default: %(default)s)")
    add_engine_args(sv)
    sv.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding: faster generation, "
                                     "same output distribution as the target model.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream an answer to one prompt",
                         description="Stream the target's answer to a prompt (chat template applied unless --raw), "
                                     "then print tokens/s and the drafter's acceptance figures to stderr.")
    gen.add_argument("prompt", nargs="?", default=None, help="the user message (default: read stdin)")
    gen.add_argument("--system", default=None, help="system message for the chat template")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    gen.add_argument("--quiet", action="store_true", help="print only the answer")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    from .cli_measure import add_calibrate_parser, add_profile_parser
    from .cli_train import (add_draft_vocab_parser, add_export_parser, add_features_parser, add_regenerate_parser,
                            add_train_parser)

    add_regenerate_parser(sub)
    add_train_parser(sub)
    add_serve_parser(sub)
    add_features_parser(sub)
    add_export_parser(sub)
    add_draft_vocab_parser(sub)
    add_calibrate_parser(sub)
    add_profile_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from . import options

    parser = build_parser()
    args = parser.parse_args(argv)
    problems = check_args(args)
    for note in (p for p in problems if p.startswith("note: ")):
        print(f"dspark: {note}", file=sys.stderr)
    errors = [p for p in problems if not p.startswith("note: ")]
    if errors:
        print("".join(f"dspark: error: {e}\n" for e in errors), end="", file=sys.stderr)
        return 2
    try:
        options.use(options_from_args(args))
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dspark: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
