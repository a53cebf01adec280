// The two symbols that FlagCX's utils.cc needs from the rest of libflagcx,
// which this CPU-only check does not link (no device, no datatypes used).
#include "adaptor.h"

struct flagcxDeviceAdaptor *deviceAdaptor = NULL;
size_t getFlagcxDataTypeSize(flagcxDataType_t) { return 0; }
