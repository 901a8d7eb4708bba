#!/usr/bin/env python
"""Train SiameseXML (siamese encoder, label-text / centroid shortlist, one re-parameterised classifier per label) on
Extreme Classification Repository files.

    accelerate launch --config_file training_scripts/accelerate/single_process.yaml training_scripts/train_siamesexml.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/siamesexml

    python training_scripts/train_siamesexml.py ... --encoder_type boe   # the paper's bag-of-embeddings encoder

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True)) and
OUT/eval_results.json. The modules, their defaults and flags: hf_xmc/training/recipes/siamesexml.py and the README.
"""

# The recipe lives in the package (hf_xmc/training/recipes/siamesexml.py) so that `hf-xmc train siamesexml` runs the same code.
from hf_xmc.training.recipes.siamesexml import main

if __name__ == "__main__":
    import sys

    from hf_xmc.training.script_utils import run_script

    sys.exit(run_script(main))  # an input fault: one line and exit status 2 (--debug: the traceback)
