"""Synthesize English utterances with reference texts: training audio for `specwhisper distill`
and held-out audio to measure a draft's acceptance on.

Question answered: none (a data maker). Each utterance is 2-5 sentences (at most
~300 characters, < 30 s) from a small template
grammar (seeded), spoken by a flite voice (kal16, slt, rms, awb) or an espeak-ng variant, stored as
16 kHz mono 16-bit WAV with `references.json` ([{file, text, voice}], the format of
specwhisper/samples and bench/e2e.py). A sentence belongs to exactly one split (train or heldout,
by a hash of its text), so the two never share a sentence, and none equals a bundled sample.

    python bench/make_speech.py --out /tmp/speech-train --n 300
    python bench/make_speech.py --out /tmp/speech-heldout --n 20 --split heldout
The grammar is small (14 templates): a draft trained on it learns that domain; held-out
acceptance on it is in-domain. `--text fortunes` draws instead from the ≈ 12 000 plain English
sentences of the Debian `fortunes` files (varied everyday English, none of bench/cpu.py's
sentences), and `--voices espeak` leaves out the flite voices bench/cpu.py speaks with, so a draft
trained on that audio is measured on other sentences and other voices:

    python bench/make_speech.py --out /tmp/speech-fortunes --n 300 --text fortunes --voices espeak
Needs flite, espeak-ng and sox on PATH (and the Debian package `fortunes` for --text fortunes).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import wave
import zlib
from pathlib import Path

FLITE_VOICES = ("kal16", "slt", "rms", "awb")
ESPEAK_VOICES = ("en-us", "en-us+f3", "en-gb", "en-gb-x-rp+m3", "en+f2", "en-us+m7")
HELDOUT_SHARE = 8  # one sentence in 8 (by text hash) is held out
MAX_SECONDS = 29.5
MAX_CHARS = 300  # keeps an utterance under 30 s (one Whisper window) for every voice

NAMES = ["Maria", "James", "the doctor", "our manager", "my neighbor", "the new teacher", "Professor Chen",
         "the pilot", "your sister", "the mayor", "a young engineer", "the gardener", "Tom", "Alice",
         "the driver", "the chef", "our lawyer", "the nurse", "Grandma", "the captain"]
PLACES = ["the station", "the museum", "the airport", "the hospital", "the old bridge", "the market",
          "the public library", "the stadium", "the harbor", "the bakery", "the post office",
          "the town hall", "the river bank", "the hotel lobby", "the parking garage", "the school gym"]
DAYS = ["on Monday", "on Friday morning", "next week", "tomorrow evening", "this afternoon",
        "at noon", "after lunch", "before sunrise", "on the weekend", "in early spring", "last night",
        "at half past eight", "in about ten minutes", "by the end of the month"]
THINGS = ["the blue umbrella", "a box of apples", "the spare keys", "two concert tickets",
          "the quarterly report", "a bag of rice", "the red notebook", "some fresh bread",
          "the broken laptop", "a bottle of water", "the train schedule", "three wooden chairs",
          "the project budget", "a warm jacket", "the medicine", "a set of paint brushes"]
VERBS = ["brought", "forgot", "found", "ordered", "lost", "returned", "painted", "checked",
         "repaired", "packed", "delivered", "borrowed", "sold", "cleaned"]
ADJ = ["quiet", "crowded", "expensive", "comfortable", "dangerous", "beautiful", "noisy", "cold",
       "bright", "empty", "famous", "modern", "tiny", "enormous"]
EVENTS = ["the concert", "the board meeting", "the football match", "the science fair",
          "the wedding", "the job interview", "the flight to Denver", "the dentist appointment",
          "the city marathon", "the cooking class", "the annual sale", "the piano lesson"]
CHANGES = ["was cancelled", "starts an hour later", "has been postponed", "was moved indoors",
           "ended early", "is sold out", "will be shown online", "went better than expected"]
NUMBERS = ["three", "seven", "twelve", "fifteen", "forty", "sixty", "a hundred", "two thousand",
           "eighteen", "ninety"]
UNITS = ["dollars", "kilometers", "minutes", "people", "pages", "degrees", "boxes", "percent"]
REASONS = ["because of the storm", "since the road was closed", "although nobody asked",
           "so that everyone could rest", "after a long discussion", "without any warning",
           "because the power went out", "as the sun was setting"]

TEMPLATES = [
    "{name} {verb} {thing} at {place} {day}.",
    "{event} {change} {reason}.",
    "Can you meet me at {place} {day}?",
    "The {adj} room near {place} costs {number} {unit}.",
    "{name} said that {event} {change}.",
    "Please remember to bring {thing} to {place}.",
    "We walked {number} {unit} to {place} {reason}.",
    "Why did {name} leave {thing} at {place}?",
    "{day}, {name} {verb} {thing} {reason}.",
    "I think {place} is too {adj} for {event}.",
    "About {number} {unit} were counted at {place} {day}.",
    "Nobody expected that {event} {change}.",
    "{name} will call you {day} about {thing}.",
    "It was a {adj} day, and {name} {verb} {thing}.",
]


def sentence(rng: random.Random) -> str:
    text = rng.choice(TEMPLATES).format(
        name=rng.choice(NAMES), verb=rng.choice(VERBS), thing=rng.choice(THINGS), place=rng.choice(PLACES),
        day=rng.choice(DAYS), adj=rng.choice(ADJ), event=rng.choice(EVENTS), change=rng.choice(CHANGES),
        number=rng.choice(NUMBERS), unit=rng.choice(UNITS), reason=rng.choice(REASONS))
    text = re.sub(r"\ba ([aeiou])", r"an \1", text)
    return text[0].upper() + text[1:]


FORTUNES = Path("/usr/share/games/fortunes")
PLAIN_SENTENCE = re.compile(r"[A-Z][A-Za-z ,.'?!;-]*[a-z][.?!]")


def fortune_sentences(folder: Path = FORTUNES) -> list[str]:
    """Plain sentences (6+ words, 30-160 characters, letters and simple punctuation only) of the
    fortune files in `folder`, sorted and deduplicated."""
    if not folder.is_dir():
        raise SystemExit(f"{folder} not found: install the Debian package `fortunes` (apt-get install fortunes)")
    found = set()
    for path in sorted(folder.iterdir()):
        if path.suffix or not path.is_file():  # .dat index and .u8 copies
            continue
        for entry in re.split(r"^%$", path.read_text(errors="ignore"), flags=re.M):
            entry = " ".join(re.sub(r"\n\s*--.*", "", entry, flags=re.S).split())  # drop the attribution
            for s in re.split(r"(?<=[.!?])\s+", entry):
                if 30 <= len(s) <= 160 and len(s.split()) >= 6 and PLAIN_SENTENCE.fullmatch(s):
                    found.add(s)
    return sorted(found)


def bench_texts() -> set[str]:
    """bench/cpu.py's evaluation sentences (kept out of every split)."""
    import ast

    tree = ast.parse((Path(__file__).parent / "cpu.py").read_text())
    found = [node.value for node in tree.body if isinstance(node, ast.Assign)
             and any(getattr(t, "id", None) == "SENTENCES" for t in node.targets)]
    return set(ast.literal_eval(found[0])) if found else set()


def split_of(text: str) -> str:
    return "heldout" if zlib.crc32(text.encode()) % HELDOUT_SHARE == 0 else "train"


def bundled_texts() -> set[str]:
    try:
        from specwhisper.samples import references
        return set(references().values())
    except ImportError:
        return set()


def synthesize(text: str, voice: str, out: Path, tmp: Path) -> None:
    raw = tmp / "raw.wav"
    engine, name = voice.split(":", 1)
    if engine == "flite":
        cmd = ["flite", "-voice", name, "-t", text, "-o", str(raw)]
    else:
        cmd = ["espeak-ng", "-v", name, "-s", "155", "-w", str(raw), text]
    subprocess.run(cmd, check=True, capture_output=True)
    # 16 kHz mono 16-bit (-R: repeatable dither), silence trimmed, 0.2 s kept at both ends
    subprocess.run(["sox", "-R", str(raw), "-r", "16000", "-c", "1", "-b", "16", str(out),
                    "silence", "1", "0.02", "0.1%", "reverse", "silence", "1", "0.02", "0.1%", "reverse",
                    "pad", "0.2", "0.2"], check=True, capture_output=True)


def seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        return w.getnframes() / w.getframerate()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for utt_NNNN.wav + references.json")
    p.add_argument("--n", type=int, default=300, help="number of utterances")
    p.add_argument("--split", choices=["train", "heldout"], default="train")
    p.add_argument("--sentences", type=int, nargs=2, default=(2, 5), metavar=("MIN", "MAX"),
                   help="sentences per utterance (inclusive range)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", choices=["grammar", "fortunes"], default="grammar",
                   help="sentence source: the template grammar or the Debian fortune files")
    p.add_argument("--voices", choices=["all", "flite", "espeak"], default="all",
                   help="voices to rotate through (bench/cpu.py speaks with the flite voices)")
    args = p.parse_args(argv)

    rng = random.Random(f"{args.split}-{args.seed}")
    voices = ([f"flite:{v}" for v in FLITE_VOICES] if args.voices != "espeak" else []) \
        + ([f"espeak-ng:{v}" for v in ESPEAK_VOICES] if args.voices != "flite" else [])
    exclude = bundled_texts() | bench_texts()
    if args.text == "fortunes":
        pool = [t for t in fortune_sentences() if split_of(t) == args.split and t not in exclude]
        rng.shuffle(pool)
        draw = iter(pool)
        sentence_of = lambda rng: next(draw)  # noqa: E731  (each sentence used once)
    else:
        sentence_of = sentence
    args.out.mkdir(parents=True, exist_ok=True)
    entries = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.n):
            n_sent = rng.randint(*args.sentences)
            parts: list[str] = []
            while len(parts) < n_sent:
                s = sentence_of(rng)
                if split_of(s) == args.split and s not in exclude and s not in parts:
                    parts.append(s)
                if len(" ".join(parts)) > MAX_CHARS and len(parts) > 1:
                    parts.pop()
                    break
            voice, name = voices[i % len(voices)], f"utt_{i:04d}.wav"
            while True:  # a slow voice may pass 30 s: drop sentences until it fits one window
                text = " ".join(parts)
                synthesize(text, voice, args.out / name, Path(tmp))
                if seconds(args.out / name) <= MAX_SECONDS or len(parts) == 1:
                    break
                parts.pop()
            entries.append({"file": name, "text": text, "voice": voice})
            if (i + 1) % 25 == 0:
                print(f"{i + 1}/{args.n}", file=sys.stderr)
    (args.out / "references.json").write_text(json.dumps(entries, indent=2) + "\n")
    print(f"{len(entries)} utterances in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
