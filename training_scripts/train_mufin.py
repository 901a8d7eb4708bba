#!/usr/bin/env python
"""Train MUFIN (multi-modal extreme classification) on Extreme Classification Repository files with images.

    python training_scripts/train_mufin.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/msmarco-distilbert-base-v4 \
        --vision_model_name_or_path google/vit-base-patch32-224-in21k --output_dir out/mufin

Points and labels may carry ``"images": [paths]`` in their JSON lines. Runs Module I (siamese pre-training,
--siamese_epochs), Module II (label centroids + bag/centroid index + shortlist of --hard_negative_top_k labels per
item), Module IV (fine-tuning with --num_positives positives and --ranker_negatives shortlist negatives per item,
--num_train_epochs, encoders at --ranker_learning_rate). Writes OUT/ (AutoModel.from_pretrained(OUT,
trust_remote_code=True), image processor and label index included) and OUT/eval_results.json.
"""

# The recipe lives in the package (hf_xmc/training/recipes/mufin.py) so that `hf-xmc train mufin` runs the same code.
from hf_xmc.training.recipes.mufin import main

if __name__ == "__main__":
    import sys

    from hf_xmc.training.script_utils import run_script

    sys.exit(run_script(main))  # an input fault: one line and exit status 2 (--debug: the traceback)
