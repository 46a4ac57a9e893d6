"""tfpod's command line: `python main.py --gin_file=gin/lm_tiny.gin --model_dir=DIR ...`.

The flags, gin bindings and modes live in tfpod/main.py (also installed as the
`tfpod` console script); run with --helpfull for every flag.
"""

import tfpod  # noqa: F401  (first: goodput counts this launch's start-up from here)
from absl import app

from tfpod.main import main

if __name__ == "__main__":
    app.run(main)
