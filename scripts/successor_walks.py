"""Text in which an induction head pays: each line a walk over the letters a-h that follows the line's own random
successor map, one letter in five drawn at random instead (seeded). The corpus of guide 14's probe picture:

    python scripts/successor_walks.py walks.txt
    gptlab prepare walks.txt --out data/walks
    gptlab train --data data/walks --run runs/walks --n-layer 2 --n-head 2 --n-embd 32 --block-size 32 \
        --batch-size 128 --max-steps 1500 --lr 3e-3 --warmup-steps 0 --weight-decay 0 --beta2 0.99 --dropout 0 \
        --eval-interval 50 --eval-batches 2 --precision fp32 --probe induction
"""

import sys

import torch

LETTERS, LINES, LENGTH, JUMP = "abcdefgh", 2500, 200, 0.2


def walks(seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(LINES):
        successor = torch.randperm(len(LETTERS), generator=g)
        x = [int(torch.randint(len(LETTERS), (1,), generator=g))]
        for _ in range(LENGTH - 1):
            jump = float(torch.rand(1, generator=g)) < JUMP
            x.append(int(torch.randint(len(LETTERS), (1,), generator=g)) if jump else int(successor[x[-1]]))
        lines.append("".join(LETTERS[i] for i in x))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(walks())
