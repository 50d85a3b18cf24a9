"""`splitmoe logits` and `splitmoe generate`: the model in one process, no services."""
from __future__ import annotations

import argparse


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids is empty")
    return ids


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", help="path to a GGUF file (default: the built-in demo model, trained to answer simple questions)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="float32: the exact reference path; bfloat16: the serving fast path")
    p.add_argument("--device", default=None, help="torch device for attention (default: cuda if present, else cpu)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("logits", help="write float32 logits [n_tokens, n_vocab] of every position")
    _add_model_args(p)
    p.add_argument("--token-ids", type=_token_ids, required=True, help="e.g. 5,17,300 (used as given, no BOS)")
    p.add_argument("--out", required=True, help="output .npy path")
    p.set_defaults(run=cmd_logits)

    p = sub.add_parser("generate", help="print greedy text for a prompt")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("-n", "--max-tokens", type=int, default=32, help="tokens to generate at most")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.set_defaults(run=cmd_generate)


def _runner(args: argparse.Namespace, kv_cache_tokens: int):
    import torch

    from splitmoe.attention_service.model.runner import DTYPES, ModelRunner, RunnerOptions, default_device

    if args.model is None:
        from splitmoe.demo import trained_model_path

        args.model = trained_model_path()
    device = torch.device(args.device) if args.device else default_device()
    options = RunnerOptions(dtype=DTYPES[args.dtype], device=device, kv_cache_tokens=kv_cache_tokens)
    return ModelRunner.from_gguf(args.model, options)


def cmd_logits(args: argparse.Namespace) -> int:
    from splitmoe.attention_service.model.sequence import Sequence

    runner = _runner(args, kv_cache_tokens=len(args.token_ids))
    if max(args.token_ids) >= runner.cfg.vocab_size or min(args.token_ids) < 0:
        raise ValueError(f"--token-ids: ids must lie in [0, {runner.cfg.vocab_size})")
    logits = runner.step([Sequence(0, args.token_ids)], all_logits=True)
    if not logits.isfinite().all():  # GGUF has no checksum: NaN weights load, and must not pass as a result
        raise ValueError(f"{runner.gguf.path.name}: {int((~logits.isfinite()).sum())} of {logits.numel()} logits "
                         "are not finite: the file's weights hold NaN or infinity")
    import numpy as np

    np.save(args.out, logits.cpu().numpy().astype(np.float32))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from splitmoe.attention_service.model.generate import greedy_tokens
    from splitmoe.modelfile.chat_template import ChatTemplate
    from splitmoe.modelfile.tokenizer import Tokenizer

    runner = _runner(args, kv_cache_tokens=4096)
    tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    text = args.prompt
    if args.chat:
        template = ChatTemplate.from_gguf_metadata(runner.gguf.metadata, tokenizer)
        text = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text)
    out: list[int] = []
    for token in greedy_tokens(runner, prompt_ids, args.max_tokens, tokenizer.stop_ids):
        if token in tokenizer.stop_ids:
            break
        out.append(token)
    print(tokenizer.decode(out, skip_special_tokens=True))
    return 0
