"""Convert to grouped-query / multi-query attention and uptrain:
python scripts/uptrain.py ckpt=... attn.n_kv_head=2 [uptrain.init=mean] [uptrain.fraction=0.05]
python scripts/uptrain.py --config-name uptrain_study ckpt=...    # the ablation study"""

import sys

import hydra
from omegaconf import DictConfig

import lm.config  # noqa: F401  the attn group's schemas, also where hydra.searchpath=... replaces conf's
from lm.config.attn import load_attention_kinds
from lm.util.cli import exit_on_user_error, run_script


@hydra.main(config_path="../conf", config_name="uptrain", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from lm.config.uptrain import UptrainRun

    with exit_on_user_error():
        run = UptrainRun.from_config(cfg)  # the one place the composed config becomes typed settings
        if run.study is not None:
            from lm.studies.uptrain_ablation import run_study

            run_study(cfg)  # it composes each arm from the config, and types each as it plans it
        else:
            from lm.training.uptraining import uptrain

            uptrain(run)


if __name__ == "__main__":
    sys.exit(run_script(main, start=load_attention_kinds))  # the kinds outside lm/ too
