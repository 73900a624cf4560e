#!/usr/bin/env bash
# Synthesize the bundled speech samples: short English utterances spoken by Debian's flite
# and espeak-ng voices, stored as 16 kHz mono 16-bit WAV, plus references.json
# (file, text, voice). Needs flite, espeak-ng, sox and python3. Rerun from anywhere:
#   bash specwhisper/samples/make_samples.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# engine|voice|file|text
samples=(
  "flite|slt|flite_slt_01.wav|The weather today will be mostly sunny, with a high of 72 degrees."
  "flite|slt|flite_slt_02.wav|Please turn off the lights and lock the door before you leave."
  "flite|rms|flite_rms_01.wav|The city council voted on Tuesday to build a new library."
  "flite|rms|flite_rms_02.wav|To reset your password, open the settings page and click security."
  "flite|awb|flite_awb_01.wav|The train to Boston leaves from platform 4 in 20 minutes."
  "flite|kal16|flite_kal16_01.wav|Traffic on the main highway is moving slowly because of an accident."
  "espeak-ng|en-us|espeak_en-us_01.wav|Our store is open from nine in the morning until six in the evening."
  "espeak-ng|en-us+f3|espeak_en-us-f3_01.wav|The meeting has been moved to Thursday afternoon."
)

json="["
for entry in "${samples[@]}"; do
  IFS='|' read -r engine voice file text <<<"$entry"
  raw="$tmp/${file%.wav}.raw.wav"
  if [[ $engine == flite ]]; then
    flite -voice "$voice" -t "$text" -o "$raw"
  else
    espeak-ng -v "$voice" -s 160 -w "$raw" "$text"
  fi
  # 16 kHz mono 16-bit (-R: repeatable dither); trim leading/trailing silence, keep 0.2 s of it at both ends
  sox -R "$raw" -r 16000 -c 1 -b 16 "$here/$file" \
    silence 1 0.02 0.1% reverse silence 1 0.02 0.1% reverse pad 0.2 0.2
  json+=$(python3 -c 'import json, sys; print(json.dumps(dict(file=sys.argv[1], text=sys.argv[2], voice=sys.argv[3])))' \
    "$file" "$text" "$engine:$voice")","
done
python3 -c 'import json, sys; print(json.dumps(json.loads(sys.argv[1]), indent=2))' "${json%,}]" \
  >"$here/references.json"
