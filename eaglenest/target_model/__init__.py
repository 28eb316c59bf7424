"""The target model at run time: loading it, capturing its aux hidden states, layer ids."""
