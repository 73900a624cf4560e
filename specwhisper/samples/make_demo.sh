#!/usr/bin/env bash
# Synthesize the demo recording of `specwhisper demo`: a ≈ 2 minute radio programme read by four
# flite voices in turns (pauses between sentences and longer ones between speakers), stored as
# 16 kHz mono 16-bit FLAC (demo.flac) with its reference transcript (demo.json: the turns and
# the whole text). Needs flite, sox and python3. Rerun from anywhere:
#   bash specwhisper/samples/make_demo.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# voice|text (one turn; sentences split on ". ")
turns=(
  "slt|Good evening and welcome to the program. Tonight we talk about the new train line that will connect the two largest cities in the region."
  "rms|Thank you for having me. The project started four years ago, and the first trains should run before the end of next summer."
  "slt|Many listeners have asked about the price of a ticket. Will it be more expensive than the bus?"
  "rms|A single trip will cost a little more than the bus, but the journey will take less than half the time. Students and older passengers will pay a reduced fare."
  "awb|I would like to add that the stations have been designed with bicycles in mind. Every platform will have a lift, and there will be parking for more than two hundred bikes."
  "slt|What about the people who live near the tracks? Some of them are worried about noise at night."
  "awb|That is a fair question. The trains are electric and quite quiet, and we have built walls along the houses closest to the line. There will be no freight traffic after ten in the evening."
  "kal16|Let me read a message from a listener. She writes that the old station in her village has been closed for years, and she hopes it will open again."
  "rms|We are studying that station right now. If the numbers look good, it could reopen in the second phase of the project."
  "slt|Before we finish, tell us one thing that surprised you during the work."
  "awb|We found the remains of an old wooden bridge while digging near the river. The museum has taken the pieces, and they will be shown to the public next spring."
  "kal16|That is all for tonight. Thank you to our guests, and thank you for listening. Good night."
)

parts=()
json="["
i=0
for entry in "${turns[@]}"; do
  IFS='|' read -r voice text <<<"$entry"
  # one sentence at a time: flite's pauses between sentences are short
  while IFS= read -r sentence; do
    [[ -z $sentence ]] && continue
    raw="$tmp/$i.raw.wav"
    flite -voice "$voice" -t "$sentence" -o "$raw"
    sox -R "$raw" -r 16000 -c 1 -b 16 "$tmp/$i.wav" \
      silence 1 0.02 0.1% reverse silence 1 0.02 0.1% reverse pad 0 0.5
    parts+=("$tmp/$i.wav")
    i=$((i + 1))
  done < <(python3 -c 'import re, sys; print("\n".join(re.split(r"(?<=[.?!]) ", sys.argv[1])))' "$text")
  sox -n -r 16000 -c 1 -b 16 "$tmp/gap$i.wav" trim 0 0.7  # a longer pause between speakers
  parts+=("$tmp/gap$i.wav")
  json+=$(python3 -c 'import json, sys; print(json.dumps(dict(voice="flite:" + sys.argv[1], text=sys.argv[2])))' "$voice" "$text")","
done
sox "${parts[@]}" -C 8 "$here/demo.flac"
python3 -c 'import json, sys; turns = json.loads(sys.argv[1]); print(json.dumps(dict(file="demo.flac", text=" ".join(t["text"] for t in turns), turns=turns), indent=2))' \
  "${json%,}]" >"$here/demo.json"
