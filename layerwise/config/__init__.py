"""The config room: schema (typed dataclasses), store (ConfigStore, resolvers, compose), validate (the
config's own rules and Hydra's composition errors), errors (ConfigError). Imports no other room."""
