"""Write the example's dataset: data/ratings/train.csv and test.csv (user,item,rating).

    python -m ratings.prepare [OUT_DIR]      # default: data (relative to where you run it)

MovieLens-shaped ratings from a hidden low-rank taste model, generated from a fixed seed (so
every machine gets the same files, and nothing is downloaded): 600 users, 400 items, 1-5 stars
in half steps, 48,000 ratings for training and 12,000 for test. Any CSV with the same columns
works in its place.
"""

import os
import sys

import numpy as np

USERS, ITEMS, RANK, TRAIN, TEST, SEED = 600, 400, 4, 48_000, 12_000, 2024


def ratings(rng: np.random.Generator, n: int, users, items, user_bias, item_bias) -> np.ndarray:
    u = rng.integers(0, USERS, n)
    i = rng.integers(0, ITEMS, n)
    taste = (users[u] * items[i]).sum(axis=1) + user_bias[u] + item_bias[i]
    noisy = taste + rng.normal(0.0, 0.35, n)
    stars = np.clip(np.round((3.2 + noisy) * 2) / 2, 1.0, 5.0)
    return np.stack([u, i, stars], axis=1)


def main(out: str = "data") -> None:
    rng = np.random.default_rng(SEED)
    users = rng.normal(0.0, 0.6, (USERS, RANK))
    items = rng.normal(0.0, 0.6, (ITEMS, RANK))
    user_bias, item_bias = rng.normal(0.0, 0.4, USERS), rng.normal(0.0, 0.4, ITEMS)
    folder = os.path.join(out, "ratings")
    os.makedirs(folder, exist_ok=True)
    for name, n in (("train", TRAIN), ("test", TEST)):
        table = ratings(rng, n, users, items, user_bias, item_bias)
        path = os.path.join(folder, f"{name}.csv")
        np.savetxt(
            path,
            table,
            fmt=["%d", "%d", "%.1f"],
            delimiter=",",
            header="user,item,rating",
            comments="",
        )
        print(f"wrote {path}: {n} ratings")


if __name__ == "__main__":
    main(*sys.argv[1:2])
