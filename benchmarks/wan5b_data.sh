#!/usr/bin/env bash
# Makes and encodes the dataset of benchmarks/train_wan5b.sh under DIR (DIR/.encoded marks it done; a DIR
# without that mark is made again): 13 episodes (data/episode_frames_wan5b.txt, or FRAMES="..." latent frame
# counts), two 128x128 cameras, 30 action channels (32 video + 4 action tokens per latent frame), text from the
# hash encoder (512 x 4096).
#
#   PYTHON=.venv/bin/python benchmarks/wan5b_data.sh DIR      # PYTHON defaults to python3
set -euo pipefail
dir=${1:?usage: wan5b_data.sh DIR}
PY=${PYTHON:-python3}
[ -f "$dir/.encoded" ] && exit 0
lengths=""  # video frames per episode
for f in ${FRAMES:-}; do lengths+="$((4 * f - 3)),"; done
[ -n "$lengths" ] || lengths=$(grep -v '^#' "$(dirname "$0")/../data/episode_frames_wan5b.txt" | paste -sd, -),
rm -rf "$dir"
"$PY" -m flexpack.cli make-dataset "$dir" --cameras 2 --size 128 --action-dim 30 --lengths "${lengths%,}"
"$PY" -m flexpack.cli encode --dataset "$dir" --text-encoder hash:4096x512
touch "$dir/.encoded"
