"""How far `echo` prompt scoring (one pass over the whole prompt, `verispec.logprobs.prompt_logprobs`: what
lm-eval's log-likelihoods read) is from the log-probability a generation of the same prefix reports for
its first token (a fresh prompt per position: the context in a pass of its own, through the int4
projections' dense twins when longer than `verispec.models.int4.DENSE_ABOVE` tokens, then the last
position through the int4 kernel), and which kernels the echo pass runs.

    python benchmarks/echo_scoring.py                                  # the int4 Qwen target
    python benchmarks/echo_scoring.py --model qwen2.5-coder-1.5b-int4 --prompt "def f(x):"
"""

from __future__ import annotations

import argparse

import torch
from common import environment

from verispec.logprobs import prompt_logprobs
from verispec.models import int4, load_model

PROMPT = ("def is_prime(n):\n    if n < 2:\n        return False\n    for i in range(2, int(n ** 0.5) + 1):\n"
          "        if n % i == 0:\n            return False\n    return True\n\nprint(is_prime(7))\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-int4")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    print(environment())
    model = load_model(args.model)
    ids = model.encode(args.prompt)
    calls = [0]
    original = int4.Int4Linear.__call__

    def counted(self, x):
        calls[0] += 1
        return original(self, x)

    int4.Int4Linear.__call__ = counted
    entries = prompt_logprobs(model, ids, 0)
    int4.Int4Linear.__call__ = original
    gaps = []
    for i in range(1, len(ids)):  # position i as a generation scores its first token
        logits = model.session().logits_for(torch.tensor([ids[:i]]), 1)[0, -1]  # [V]
        gaps.append(abs(float(torch.log_softmax(logits.double(), -1)[ids[i]]) - entries[i]["raw_logprob"]))
    short = gaps[: int4.DENSE_ABOVE]
    print(f"{args.model}: prompt of {len(ids)} tokens; the echo pass made {calls[0]} int4 projection calls")
    print(f"|echo - generation of the prefix| per position: mean {sum(gaps) / len(gaps):.4f}, max "
          f"{max(gaps):.4f} nats; where the prefix is at most {int4.DENSE_ABOVE} tokens (int4 throughout): "
          f"max {max(short):.4f}")


if __name__ == "__main__":
    main()
