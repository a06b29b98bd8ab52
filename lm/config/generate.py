"""scripts/generate.py's settings, declared beside the generation they drive (lm.generation.settings),
stored for conf/generate.yaml to compose (`generate_settings`)."""

from lm.config.settings import store
from lm.generation.settings import GenerateSettings

store("generate_settings", GenerateSettings)
