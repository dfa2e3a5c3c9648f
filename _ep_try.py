import sys, torch
from tests.test_config import make_cfg
from src.config.validate import validate
from src.resolved import resolve
from src.trainer.loop import train
from tests.distributed import run_distributed

def rank_fn(rank, world, cfg, run_dir):
    return train(cfg, run_dir, torch.device("cpu"), resolve(cfg))

if __name__ == "__main__":
    world, ep = int(sys.argv[1]), int(sys.argv[2])
    cfg = make_cfg("model=moe_tiny", "model.max_seq_len=32", "data=synthetic", "data.num_tokens=20000", "logger=none",
        "trainer.max_steps=3", "trainer.batch_size=8", "trainer.log_every=1", "trainer.val_every=0",
        "trainer.progress=false", "trainer.peak_tflops=1", f"trainer.devices={world}",
        f"sharding.expert_parallel={ep}", "sharding.policy=block", "model.load_balance=aux_free", *sys.argv[3:])
    validate(cfg)
    import json, tempfile, os
    d = tempfile.mkdtemp()
    run_distributed(rank_fn, world, cfg, d)
    rows = [json.loads(l) for l in open(os.path.join(d, "metrics.jsonl"))]
    print([r["loss"] for r in rows if "loss" in r])
    print([r.get("moe/layer0/tokens_max") for r in rows if "loss" in r])
