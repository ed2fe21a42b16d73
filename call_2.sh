R=/tmp/r; mkdir -p $R
pack() { tar czf - -C /tmp r | split -b 15M - $OUT/all.tgz.; }
trap pack EXIT
bounded() { local s=$1; shift; timeout -s INT $s "$@"; }
S=$(date +%s)
bounded 250 python3 bench/decode_ways.py --ways today,triton-mlp-only,uncompiled --agreement --with-transformers --timeout 110 --out $R/ways.json > $R/ways.log 2>&1
echo "ways $(( $(date +%s) - S ))" >> $R/times.txt
bounded 150 python3 bench/node_check.py --decode-agreement --gpus 1 --batch-size 1024 --out $R/node.json > $R/node.log 2>&1
echo "node $(( $(date +%s) - S ))" >> $R/times.txt
bounded 150 python3 -m pytest -q -rf -m gpu tests/unit/test_generation.py -k "triton or qwen or one_row" -p no:cacheprovider > $R/gputests.log 2>&1
echo "tests $(( $(date +%s) - S ))" >> $R/times.txt
