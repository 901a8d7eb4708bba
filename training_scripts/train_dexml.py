#!/usr/bin/env python
"""Train DEXML (a pure dual encoder with the DecoupledSoftmax loss) on Extreme Classification Repository files.

    python training_scripts/train_dexml.py \
        --train_file trn.json.gz --test_file tst.json.gz --label_file lbl.json.gz \
        --model_name_or_path sentence-transformers/all-MiniLM-L6-v2 --output_dir out/dexml

    accelerate launch --num_processes 2 training_scripts/train_dexml.py ...   # several processes

Writes OUT/ (a model directory loadable with AutoModel.from_pretrained(OUT, trust_remote_code=True), label index
included) and OUT/eval_results.json (test_P@k, test_nDCG@k, test_PSP@k, test_R@10/100, train_runtime,
test_samples_per_second). Every TrainingArguments flag works (--learning_rate, --num_train_epochs, --seed, ...), and
so do the training-engine flags of XMCTrainingArguments: --cluster_batching, --hard_negatives, --positive_sampling,
--gradient_cache_chunk_size, --label_pool all (DEXML's brute-force all-label mode), --resume_from_checkpoint.
"""

# The recipe lives in the package (hf_xmc/training/recipes/dexml.py) so that `hf-xmc train dexml` runs the same code.
from hf_xmc.training.recipes.dexml import main

if __name__ == "__main__":
    import sys

    from hf_xmc.training.script_utils import run_script

    sys.exit(run_script(main))  # an input fault: one line and exit status 2 (--debug: the traceback)
