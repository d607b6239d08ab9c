"""One rank of a 2-rank gloo job whose ranks stand for two machines (each its machine's first
rank, LOCAL_RANK 0) sharing one corpus cache folder (test_distributed.py). It builds or opens
the corpus as mid-training does, counting the builds it makes in `<out>/builds-<rank>`, and
writes the corpus's train token count to `<out>/tokens-<rank>`. Arguments: the config file, `<out>`."""

import sys
from pathlib import Path

import whetstone.data.build as build
from whetstone.config import load_config
from whetstone.midtrain.config import MidtrainConfig
from whetstone.midtrain.setup import _corpus_in_rank_order
from whetstone.training.distributed import torchrun_group, world
from whetstone.utils.processes import exit_process


def main(config_file: str, out: Path) -> None:
    real_build = build._build_into

    def counted(folder, *args, **kwargs):
        with open(out / f"builds-{world()[0]}", "a") as builds:
            builds.write("1\n")
        return real_build(folder, *args, **kwargs)

    build._build_into = counted
    with torchrun_group("cpu"):
        corpus = _corpus_in_rank_order(load_config(MidtrainConfig, Path(config_file)), None)
        (out / f"tokens-{world()[0]}").write_text(str(corpus.manifest["tokens"]["train"]))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    exit_process(0)  # as the whetstone command's ranks end
