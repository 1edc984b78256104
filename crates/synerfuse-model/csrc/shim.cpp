// What the model shim's functions share: their error messages (`synerfuse::guarded`'s,
// allocated with malloc) are freed here, by the library that allocated them.
#include <cstdlib>

extern "C" void synerfuse_model_free_error(char *error) { std::free(error); }
