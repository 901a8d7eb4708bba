#!/usr/bin/env python
"""Train UniDEC (one encoder, a dual-encoder head and an extreme-classifier head, pick-some-labels pools) on Extreme
Classification Repository files.

    accelerate launch --config_file training_scripts/accelerate/single_process.yaml training_scripts/train_unidec.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/unidec

    accelerate launch --config_file training_scripts/accelerate/multi_process.yaml training_scripts/train_unidec.py ...
    python training_scripts/train_unidec.py ...                 # one process, no launcher

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), with the index
over the concatenated [DE ; classifier] label vectors) and OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k,
test_R@10/100, train_runtime, test_samples_per_second).

Defaults follow the paper's recipe at a short budget: per query 3 positives drawn with replacement by inverse
propensity, the batch's other positives, a pool capped at 256 labels per process; learning rates encoder / heads /
classifier = lr / 2 lr / 1e-3, cosine schedule with warm-up. Negatives and batches are DEXML's: one hard negative per
query from its DE-head top 100, mined a twentieth of an epoch in and every epoch after, and NGAME cluster batching
(clusters of 16) on label spaces of 10,000+ labels; query->label terms only
(--de_query_to_label_weight 0.5 --clf_query_to_label_weight 0.5 adds the paper's symmetric label->query terms, which
lost on both datasets at this budget, see README). --use_classifier false trains DePSL (the DE-only ablation). Every TrainingArguments flag and every engine flag of XMCTrainingArguments works.
"""

# The recipe lives in the package (hf_xmc/training/recipes/unidec.py) so that `hf-xmc train unidec` runs the same code.
from hf_xmc.training.recipes.unidec import main

if __name__ == "__main__":
    import sys

    from hf_xmc.training.script_utils import run_script

    sys.exit(run_script(main))  # an input fault: one line and exit status 2 (--debug: the traceback)
