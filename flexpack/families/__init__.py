"""Model families, one folder each: model, config, presets, converters, objective, sampler, exports, masks."""
