"""Entry point for `ray job submit`: stages from data to a served model as one resumable job (docs/pipeline.md).

    python -m pipelines.pipeline --config pipelines/configs/pipeline_demo.yaml [key=value ...]

Running the same command again skips the finished stages and resumes the unfinished one.
"""
import sys

from minimind_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["pipeline", *sys.argv[1:]]))
