"""L2L compute-side memory (docs/strategies/l2l.md), measured from the tensors by parallel.memory's meter.

    .venv/bin/python benchmarks/l2l_memory.py                 # depth table + m table + BERT-Large
    .venv/bin/python benchmarks/l2l_memory.py --skip-bert     # tables only (~6 min; BERT adds ~8)

1. gpt_tiny width (h=128, 4 heads), micro-batch 1 × 32 tokens, depth 4/24/96/384: the constant
   variant's peak must stay flat (±5%); the standard variant's grows by its stash only,
   (L+1)·m·b·s·h·4 bytes, while the weights in flight stay at two layers.
2. BERT-Large shape (24 × 1024, 16 heads), sequence 128: `single`'s peak (weights, gradients, Adam
   state and activations on the compute side) against L2L's; the paper reports 45% less.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerwise.reproduce.measure import batch, model_of, relay_peak, single_peak  # noqa: E402

MB = 2**20


def depth_table(depths, micro_batches_list, sequence=32, hidden=128):
    activation = sequence * hidden * 4  # one stashed tensor of one sample
    print(f"\n## gpt_tiny width (h={hidden}), micro-batch 1 × {sequence} tokens, fp32; bytes in MiB")
    print("| layers | m | constant peak | standard peak | stash (L+1)·m·b·s·h·4 | standard − stash |")
    print("|---:|---:|---:|---:|---:|---:|")
    for layers in depths:
        for micro_batches in micro_batches_list:
            tokens, targets = batch(micro_batches, sequence, masked=False)
            peaks = [relay_peak(model_of("gpt", layers, hidden, 4, sequence), tokens, targets, micro_batches, constant)
                     for constant in (True, False)]
            stash = (layers + 1) * micro_batches * activation
            print(f"| {layers} | {micro_batches} | {peaks[0] / MB:.3f} | {peaks[1] / MB:.3f} | {stash / MB:.3f} | "
                  f"{(peaks[1] - stash) / MB:.3f} |", flush=True)


def bert_large(batch_size, micro_batches, sequence=128):
    tokens, targets = batch(batch_size, sequence, masked=True)
    start = time.perf_counter()
    single = single_peak(model_of("bert", 24, 1024, 16, sequence), tokens, targets)
    print(f"single measured in {time.perf_counter() - start:.0f} s", flush=True)
    rows = [("single", single)]
    for constant in (False, True):
        model = model_of("bert", 24, 1024, 16, sequence)
        rows.append((f"l2l {'constant' if constant else 'standard'} m={micro_batches}",
                     relay_peak(model, tokens, targets, micro_batches, constant, warm_up=False)))
    print(f"\n## BERT-Large shape (24 × 1024, 16 heads), batch {batch_size} × {sequence} tokens, fp32")
    print("| strategy | compute-side peak (GiB) | / single |")
    print("|---|---:|---:|")
    for name, peak in rows:
        print(f"| {name} | {peak / 2**30:.3f} | {peak / single:.3f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 24, 96, 384])
    parser.add_argument("--bert-batch", type=int, default=8)
    parser.add_argument("--bert-micro-batches", type=int, default=2)
    parser.add_argument("--skip-bert", action="store_true")
    arguments = parser.parse_args()
    torch.manual_seed(0)
    depth_table(arguments.depths, [1])
    depth_table([4, 24], [1, 4, 16])
    if not arguments.skip_bert:
        bert_large(arguments.bert_batch, arguments.bert_micro_batches)


if __name__ == "__main__":
    main()
