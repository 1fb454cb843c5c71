"""Small fixed word lists for needle keys and variable names (no download, no wordlist package)."""

ADJECTIVES = (
    "amber",
    "brave",
    "calm",
    "dusty",
    "eager",
    "faint",
    "gentle",
    "hollow",
    "icy",
    "jolly",
    "keen",
    "lively",
    "misty",
    "noble",
    "odd",
    "pale",
    "quiet",
    "rapid",
    "silent",
    "tidy",
    "upper",
    "vivid",
    "warm",
    "young",
    "zesty",
    "bitter",
    "cosmic",
    "golden",
    "hidden",
    "loyal",
    "modern",
    "narrow",
    "polite",
    "rustic",
    "sturdy",
)
NOUNS = (
    "anchor",
    "bridge",
    "candle",
    "desert",
    "engine",
    "falcon",
    "garden",
    "harbor",
    "island",
    "jacket",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "orchard",
    "pepper",
    "quarry",
    "river",
    "saddle",
    "tunnel",
    "valley",
    "wagon",
    "yacht",
    "zebra",
    "barrel",
    "canyon",
    "dolphin",
    "forest",
    "glacier",
    "helmet",
    "ladder",
    "mirror",
    "pillow",
)


def key_phrase(r) -> str:
    """A two-word key such as ``quiet-harbor``."""
    return f"{r.choice(ADJECTIVES)}-{r.choice(NOUNS)}"


def distinct_keys(r, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        k = key_phrase(r)
        if k not in keys:
            keys.append(k)
    return keys


def magic_number(r) -> str:
    """A 7-digit number, as RULER uses."""
    return str(r.randint(1_000_000, 9_999_999))
